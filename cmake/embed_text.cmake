# cmake -DIN=FILE -DOUT=FILE.cpp -DNAME=function -P embed_text.cmake
# Writes a C++ file defining `std::string_view pagoda::server::NAME()` that
# returns IN's text (the dashboard's page, served from the binary).
file(READ "${IN}" content)
string(FIND "${content}" ")PAGODA_TEXT\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${IN} contains the raw string's delimiter")
endif()
file(WRITE "${OUT}.tmp" "// Generated from ${IN} by cmake/embed_text.cmake: edit that file instead.\n"
     "#include <string_view>\n\nnamespace pagoda::server {\n\nstd::string_view ${NAME}() {\n"
     "  static constexpr std::string_view text = R\"PAGODA_TEXT(${content})PAGODA_TEXT\";\n  return text;\n}\n\n}  // namespace pagoda::server\n")
file(COPY_FILE "${OUT}.tmp" "${OUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUT}.tmp")
