# cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... -DGENERATOR=... -P check_install.cmake
#
# Installs the build into a fresh prefix under WORK_DIR, configures and builds
# tests/install (examples/generate.cpp against find_package(pagoda)) with only
# that prefix to find Pagoda in, and runs it on the bundled model. Fails with
# the step's output at the first step that does.
function(step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
step("cmake --install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
if(NOT EXISTS ${prefix}/include/pagoda/engine.h)
  message(FATAL_ERROR "the public headers were not installed")
endif()
if(EXISTS ${prefix}/include/sched OR EXISTS ${prefix}/include/kv)
  message(FATAL_ERROR "internal headers were installed")
endif()
step("configuring the example against the installed package"
     ${CMAKE_COMMAND} -S ${SOURCE_DIR}/tests/install -B ${WORK_DIR}/build -G ${GENERATOR}
     -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
     -DPAGODA_EXAMPLE_SOURCE=${SOURCE_DIR}/examples/generate.cpp)
step("building the example" ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
step("running the example" ${WORK_DIR}/build/generate ${SOURCE_DIR}/models/stories260K.gguf "Once upon a time")
message("${step_output}")
file(REMOVE_RECURSE ${WORK_DIR})
