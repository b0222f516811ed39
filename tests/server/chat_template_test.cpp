// Chat templates: each family's exact rendering (what its reference Hugging
// Face template produces for the same messages), detection from template
// text, and the errors.
#include "server/chat_template.h"

#include <gtest/gtest.h>

namespace pagoda::server {
namespace {

const chat_special_tokens k_spm{"<s>", "</s>"};

std::string render(chat_format f, std::vector<chat_message> m, bool gen = true,
                   const chat_special_tokens& tok = k_spm) {
  auto r = render_chat(f, m, tok, gen);
  EXPECT_TRUE(r.ok()) << r.error().message();
  return r.ok() ? *r : std::string();
}

const std::vector<chat_message> k_conv = {
    {"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello."}, {"user", "Who are you?"}};

TEST(chat_template, chatml) {
  EXPECT_EQ(render(chat_format::chatml, k_conv),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(render(chat_format::chatml, {{"user", "x"}}, false), "<|im_start|>user\nx<|im_end|>\n");
}

// What Qwen3's template renders: thinking dropped from turns before the last
// user message, kept (normalised) after it; the last assistant message always
// gets a think block, an earlier one after the query only if it has reasoning.
TEST(chat_template, qwen3_thinking_blocks) {
  const std::vector<chat_message> conv = {{"system", "Be brief."},
                                          {"user", "Hi"},
                                          {"assistant", "<think>\nsay hi\n</think>\n\nHello."},
                                          {"user", "Who are you?"}};
  EXPECT_EQ(render(chat_format::qwen3, conv),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nWho are you?<|im_end|>\n"
            "<|im_start|>assistant\n");
  // After the last query: the think block is kept, newlines normalised.
  EXPECT_EQ(render(chat_format::qwen3, {{"user", "Q"}, {"assistant", "<think>\n\nhmm\n\n</think>\nA"}}, false),
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nA<|im_end|>\n");
  // The last message without reasoning still gets an (empty) think block; an
  // earlier one without reasoning does not.
  EXPECT_EQ(render(chat_format::qwen3, {{"user", "Q"}, {"assistant", "A"}, {"assistant", "B"}}, false),
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\nB<|im_end|>\n");
}

TEST(chat_template, llama3_trims_content) {
  EXPECT_EQ(render(chat_format::llama3, {{"system", " Be brief. "}, {"user", "Hi\n"}}),
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(chat_template, llama2_system_in_first_turn_and_bos_between_turns) {
  EXPECT_EQ(render(chat_format::llama2, k_conv),
            "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello. </s><s>[INST] Who are you? [/INST]");
  EXPECT_EQ(render(chat_format::llama2, {{"user", " Hi "}}), "[INST] Hi [/INST]");
  EXPECT_FALSE(render_chat(chat_format::llama2, std::vector<chat_message>{{"user", "a"}, {"system", "b"}}, k_spm, true).ok());
}

TEST(chat_template, mistral_folds_system_into_first_user_message) {
  EXPECT_EQ(render(chat_format::mistral, k_conv),
            "[INST] Be brief.\n\nHi [/INST]Hello.</s>[INST] Who are you? [/INST]");
  auto late = render_chat(chat_format::mistral,
                          std::vector<chat_message>{{"user", "a"}, {"assistant", "b"}, {"system", "c"}}, k_spm, true);
  ASSERT_FALSE(late.ok());
  EXPECT_NE(late.error().message().find("messages[2]"), std::string::npos);
}

TEST(chat_template, gemma_uses_model_role) {
  EXPECT_EQ(render(chat_format::gemma, k_conv),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
            "<start_of_turn>user\nWho are you?<end_of_turn>\n<start_of_turn>model\n");
}

TEST(chat_template, phi3) {
  EXPECT_EQ(render(chat_format::phi3, k_conv),
            "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello.<|end|>\n"
            "<|user|>\nWho are you?<|end|>\n<|assistant|>\n");
}

TEST(chat_template, zephyr) {
  EXPECT_EQ(render(chat_format::zephyr, k_conv),
            "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello.</s>\n<|user|>\nWho are you?</s>\n"
            "<|assistant|>\n");
}

TEST(chat_template, deepseek) {
  const chat_special_tokens ds{"<\xEF\xBD\x9C" "begin\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>",
                               "<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>"};
  EXPECT_EQ(render(chat_format::deepseek, k_conv, true, ds),
            "Be brief.\n\nUser: Hi\n\nAssistant: Hello." + ds.eos + "User: Who are you?\n\nAssistant:");
  const std::string u = "<\xEF\xBD\x9C" "User\xEF\xBD\x9C>", a = "<\xEF\xBD\x9C" "Assistant\xEF\xBD\x9C>";
  EXPECT_EQ(render(chat_format::deepseek3, k_conv, true, ds),
            "Be brief." + u + "Hi" + a + "Hello." + ds.eos + u + "Who are you?" + a);
}

TEST(chat_template, plain_joins_contents) {
  EXPECT_EQ(render(chat_format::plain, {{"user", "Once upon a time"}}), "Once upon a time");
  EXPECT_EQ(render(chat_format::plain, k_conv), "Be brief.\nHi\nHello.\nWho are you?");
}

TEST(chat_template, errors_name_the_message) {
  EXPECT_FALSE(render_chat(chat_format::chatml, std::vector<chat_message>{}, k_spm, true).ok());
  auto bad = render_chat(chat_format::chatml, std::vector<chat_message>{{"user", "a"}, {"function", "b"}}, k_spm, true);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code(), errc::invalid_argument);
  EXPECT_NE(bad.error().message().find("messages[1].role"), std::string::npos);
  // A tool message needs a family with a tool format (tool_calls_test.cpp has those).
  bad = render_chat(chat_format::gemma, std::vector<chat_message>{{"user", "a"}, {"tool", "b"}}, k_spm, true);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message().find("messages[1].role"), std::string::npos);
}

TEST(chat_template, names_round_trip) {
  for (chat_format f : all_chat_formats()) EXPECT_EQ(chat_format_from_name(chat_format_name(f)), f);
  EXPECT_EQ(chat_format_from_name("jinja"), std::nullopt);
}

// Excerpts of the families' real Jinja templates (the parts with their markers).
TEST(chat_template, detects_families_from_template_text) {
  struct sample {
    const char* jinja;
    chat_format expected;
  };
  const sample samples[] = {
      {"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
       "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
       chat_format::chatml},
      // Qwen3 (its thinking switch and think blocks)
      {"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
       "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}",
       chat_format::qwen3},
      // Gemma 3 (system folded into the first user turn)
      {"{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
       "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}",
       chat_format::gemma},
      // Phi-3.5 (with a system role)
      {"{% if message['role'] == 'system' and message['content'] %}{{'<|system|>\\n' + message['content'] + "
       "'<|end|>\\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + "
       "'<|end|>\\n'}}{% endif %}",
       chat_format::phi3},
      {"{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim "
       "+ '<|eot_id|>' %}",
       chat_format::llama3},
      {"{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
       "'\\n<</SYS>>\\n\\n' + message['content'] %}{% endif %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}",
       chat_format::llama2},
      {"{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] "
       "+ ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}",
       chat_format::mistral},
      {"{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + "
       "'<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}",
       chat_format::gemma},
      {"{% for message in messages %}{% if message['role'] == 'user' %}{{'<|user|>' + '\\n' + message['content'] + "
       "'<|end|>' + '\\n' + '<|assistant|>' + '\\n'}}{% endif %}{% endfor %}",
       chat_format::phi3},
      {"{% for message in messages %}\\n{% if message['role'] == 'user' %}\\n{{ '<|user|>\\n' + message['content'] + "
       "eos_token }}\\n{% endif %}{% if loop.last and add_generation_prompt %}\\n{{ '<|assistant|>' }}{% endif %}{% endfor %}",
       chat_format::zephyr},
      {"{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + "
       "'\\n\\n' }}{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}{% endif "
       "%}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}",
       chat_format::deepseek},
      {"{{'<\xEF\xBD\x9C" "User\xEF\xBD\x9C>' + message['content']}}{{'<\xEF\xBD\x9C" "Assistant\xEF\xBD\x9C>' + "
       "content + '<\xEF\xBD\x9C" "end\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>'}}",
       chat_format::deepseek3},
  };
  for (const sample& s : samples) {
    auto f = detect_chat_format(s.jinja);
    ASSERT_TRUE(f.has_value()) << s.jinja;
    EXPECT_EQ(*f, s.expected) << chat_format_name(*f) << " for " << s.jinja;
  }
  EXPECT_EQ(detect_chat_format("{{ messages[0]['content'] }}"), std::nullopt);
}

}  // namespace
}  // namespace pagoda::server
