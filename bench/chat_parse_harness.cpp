// llama.cpp's own chat-answer parser, driven line by line: the reference bench/chat_parity.py compares
// graftmem's answers with.
//
// Built by bench/chat_parity.py (`build_harness`) from the llama.cpp vendored in the pinned
// llama-cpp-python sdist, the same sources graftmem's engine runs, into a cache directory outside the
// repository. It does what llama-server does with a chat request and its generated text:
//
//   common_chat_templates_init(template)           the model's jinja template (no model: bos/eos given)
//   common_chat_templates_apply(inputs)            the format and PEG parser for these messages / tools
//   common_chat_parse(text, is_partial=false, ...) the final answer, as the server's final response parses it
//
// stdin:  one JSON object per line:
//   {"template": "<jinja source>", "text": "<the generated text, markers written out>",
//    "tools": [OpenAI tools] (optional), "messages": [OpenAI messages] (optional, default one user turn),
//    "reasoning_format": "auto" | "deepseek" | "none" | ... (optional, default llama-server's "deepseek"),
//    "parse_tool_calls": bool (optional, default true as llama-server's), "enable_thinking": bool
//    (optional, default: the template supports it, as llama-server decides), "chat_template_kwargs": {...},
//    "bos_token": "", "eos_token": ""}
// stdout: one JSON object per line:
//   {"format": "...", "generation_prompt": "...", "content": "...", "reasoning_content": "...",
//    "tool_calls": [{"name": "...", "arguments": "..."}], "error": null | "..."}

#include "chat.h"
#include "json.h"
#include "log.h"

#include <iostream>
#include <string>

static std::string str_or(const common_json & obj, const std::string & key, const std::string & def) {
    return obj.contains(key) && obj.at(key).is_string() ? obj.at(key).get<std::string>() : def;
}

static common_json handle(const common_json & req) {
    common_json out = common_json::object();
    const std::string tmpl = req.at("template").get<std::string>();
    const std::string text = req.at("text").get<std::string>();

    auto tmpls = common_chat_templates_init(nullptr, tmpl, str_or(req, "bos_token", ""), str_or(req, "eos_token", ""));

    common_chat_templates_inputs inputs;
    common_json messages = req.contains("messages") && req.at("messages").is_array()
        ? req.at("messages")
        : common_json::parse(R"([{"role": "user", "content": "What is the weather in Paris?"}])");
    inputs.messages = common_chat_msgs_parse_oaicompat(messages);
    if (req.contains("tools") && req.at("tools").is_array()) {
        inputs.tools = common_chat_tools_parse_oaicompat(req.at("tools"));
    }
    inputs.tool_choice = COMMON_CHAT_TOOL_CHOICE_AUTO;
    auto caps = common_chat_templates_get_caps(tmpls.get());
    inputs.parallel_tool_calls = caps["supports_parallel_tool_calls"];  // llama-server's default
    inputs.add_generation_prompt = true;
    inputs.use_jinja = true;
    inputs.reasoning_format = common_reasoning_format_from_name(str_or(req, "reasoning_format", "deepseek"));
    inputs.enable_thinking = req.contains("enable_thinking") && req.at("enable_thinking").is_boolean()
        ? req.at("enable_thinking").get<bool>()
        : common_chat_templates_support_enable_thinking(tmpls.get());
    if (req.contains("chat_template_kwargs") && req.at("chat_template_kwargs").is_object()) {
        for (const auto & [key, val] : req.at("chat_template_kwargs").items()) {
            inputs.chat_template_kwargs[key] = val.dump();
        }
    }

    auto chat_params = common_chat_templates_apply(tmpls.get(), inputs);

    // as llama-server's completion params are derived from the chat params (server-schema.cpp)
    common_chat_parser_params params(chat_params);
    params.reasoning_format = inputs.reasoning_format;
    params.reasoning_in_content = false;  // not streamed: the final response
    params.parse_tool_calls = !(req.contains("parse_tool_calls") && req.at("parse_tool_calls").is_boolean())
        || req.at("parse_tool_calls").get<bool>();
    if (!chat_params.parser.empty()) {
        params.parser.load(chat_params.parser);
    }

    out["format"] = std::string(common_chat_format_name(chat_params.format));
    out["generation_prompt"] = chat_params.generation_prompt;

    common_chat_msg msg = common_chat_parse(text, /* is_partial= */ false, params);
    out["content"] = msg.content;
    out["reasoning_content"] = msg.reasoning_content;
    common_json calls = common_json::array();
    for (const auto & tc : msg.tool_calls) {
        common_json call = common_json::object();
        call["name"] = tc.name;
        call["arguments"] = tc.arguments;
        calls.push_back(call);
    }
    out["tool_calls"] = calls;
    out["error"] = nullptr;
    return out;
}

int main() {
    common_log_set_verbosity_thold(-1);  // llama.cpp's warnings go to stderr; stdout is the answers only
    std::ios::sync_with_stdio(false);
    std::string line;
    while (std::getline(std::cin, line)) {
        if (line.empty()) {
            continue;
        }
        common_json out;
        try {
            out = handle(common_json::parse(line));
        } catch (const std::exception & e) {
            out = common_json::object();
            out["error"] = std::string(e.what());
        }
        std::cout << out.dump() << "\n" << std::flush;
    }
    return 0;
}
