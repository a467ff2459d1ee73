"""The front end's pure parts: request parsing and bounds, answers, the hit index."""

from __future__ import annotations

import pytest

from dualpath.frontend import protocol as api
from dualpath.frontend.index import HitIndex

LIM = api.Limits(max_prompt_tokens=100, max_tokens=50, model="m")


def _err(fn, body) -> api.ApiError:
    with pytest.raises(api.ApiError) as e:
        fn(body, LIM)
    return e.value


def test_a_token_id_completion_parses_with_openai_defaults():
    c = api.parse_completion({"model": "m", "prompt": [1, 2, 3]}, LIM)
    assert c.prompt_ids == [1, 2, 3] and c.max_tokens == 16 and c.temperature == 1.0
    assert c.seed == -1 and not c.stream and not c.logprobs and not c.ignore_eos
    c = api.parse_completion({"model": "m", "prompt": ["hi"], "logprobs": 1, "seed": 7,
                              "stream": True, "temperature": 0}, LIM)
    assert c.prompt_text == "hi" and c.logprobs and c.seed == 7 and c.stream
    assert c.temperature == 0.0


@pytest.mark.parametrize("body, status, needle", [
    ({"model": "m", "prompt": [1], "best_of": 3}, 400, "best_of"),
    ({"model": "x", "prompt": [1]}, 404, "x"),
    ({"prompt": [1]}, 400, "model"),
    ({"model": "m", "prompt": [1] * 101}, 400, "101"),
    ({"model": "m", "prompt": [1], "max_tokens": 51}, 400, "max_tokens"),
    ({"model": "m", "prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "m", "prompt": [1], "temperature": 3}, 400, "temperature"),
    ({"model": "m", "prompt": [1], "temperature": "hot"}, 400, "temperature"),
    ({"model": "m", "prompt": [1], "n": 17}, 400, "n"),
    ({"model": "m", "prompt": [[1], [2]], "n": 2}, 400, "n"),
    ({"model": "m", "prompt": [1], "logprobs": 21}, 400, "logprobs"),
    ({"model": "m", "prompt": [1], "logprobs": True}, 400, "logprobs"),
    ({"model": "m", "prompt": [1], "logprobs": 2, "echo": True}, 400, "echo"),
    ({"model": "m", "prompt": [1], "echo": 1}, 400, "echo"),
    ({"model": "m", "prompt": [-1]}, 400, "token ids"),
    ({"model": "m", "prompt": [True]}, 400, "prompt"),
    ({"model": "m", "prompt": ""}, 400, "empty"),
    ({"model": "m", "prompt": [[1], [True]]}, 400, "a batch"),
    ({"model": "m", "prompt": [1], "stream": "yes"}, 400, "stream"),
    ({"model": "m", "prompt": [1], "stream_options": {"x": 1}}, 400, "stream_options"),
    ([1, 2], 400, "JSON object"),
])
def test_bad_completions_are_refused_naming_the_field(body, status, needle):
    e = _err(api.parse_completion, body)
    assert e.status == status
    assert needle in e.message + str(e.param)
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}


def test_chat_messages_are_checked():
    c = api.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                        "max_completion_tokens": 5, "logprobs": True}, LIM)
    assert c.chat and c.max_tokens == 5 and c.logprobs
    assert _err(api.parse_chat, {"model": "m", "messages": []}).param == "messages"
    e = _err(api.parse_chat, {"model": "m", "messages": [{"role": "user", "content": 3}]})
    assert e.param == "messages[0]"
    e = _err(api.parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x",
                                                          "tool_calls": []}]})
    assert e.param == "messages[0]"


def test_answers_have_the_openai_shapes():
    c = api.parse_completion({"model": "m", "prompt": [1], "logprobs": 1,
                              "max_tokens": 2}, LIM)
    lp = api.logprobs(c, ["a", "b"], [-0.5, -1.0], [None, None])
    a = api.answer(c, "cmpl-1", "ab", [5, 6], lp, 1, api.finish_reason(c, 2))
    assert a["object"] == "text_completion" and a["choices"][0]["finish_reason"] == "length"
    assert a["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -1.0]
    assert a["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    chat = api.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]},
                          LIM)
    ch = api.chunk(chat, "chatcmpl-1", "a", [5], None, None, first=True)
    assert ch["object"] == "chat.completion.chunk"
    assert ch["choices"][0]["delta"] == {"content": "a", "role": "assistant"}
    assert api.finish_reason(chat, 3) == "stop"


def test_the_hit_index_remembers_served_blocks_but_never_the_last_token():
    idx = HitIndex(block_tokens=4, capacity=100)
    prompt, out = list(range(10)), [10, 11, 12]
    assert idx.hit_tokens(prompt) == 0
    idx.remember(prompt, out)            # 12 tokens stored (the last one's KV never is)
    assert len(idx) == 3
    assert idx.hit_tokens(prompt + out + [99, 98]) == 12
    assert idx.hit_tokens(list(range(12))) == 8       # the last token is never a hit
    assert idx.hit_tokens([7] + prompt[1:]) == 0       # another first block: nothing


def test_the_hit_index_forgets_the_least_recently_used():
    idx = HitIndex(block_tokens=2, capacity=2)
    idx.remember([1, 2, 3, 4], [5])     # two blocks: (1,2), (1,2,3,4)
    idx.remember([9, 9], [9])           # one more: the oldest goes
    assert len(idx) == 2
    assert idx.hit_tokens([1, 2, 3, 4, 5]) == 0        # its first block was forgotten
    assert HitIndex(2, 0).hit_tokens([1, 2, 3]) == 0


def test_a_prompt_at_or_over_the_context_is_refused_in_vllms_words():
    lim = api.Limits(max_prompt_tokens=32768, max_tokens=4096, model="m", max_model_len=100)
    for n in (100, 101, 5000):
        with pytest.raises(api.ApiError) as e:
            api.check_prompt_length(n, lim)
        assert e.value.status == 400
        assert str(e.value).startswith("This model's maximum context length is 100 tokens. "
                                       f"However, your prompt contains {n} input tokens")
    api.check_prompt_length(99, lim)
    unknown = api.Limits(32768, 4096, "m")             # no context known: not checked
    api.check_prompt_length(5000, unknown)


def test_max_tokens_is_cut_to_what_the_context_leaves_as_vllm_does():
    lim = api.Limits(max_prompt_tokens=32768, max_tokens=4096, model="m", max_model_len=100)
    call = api.parse_completion({"model": "m", "prompt": [1] * 90, "max_tokens": 50}, lim)
    api.fit_to_context(call, 90, lim)
    assert call.max_tokens == 10
    assert api.finish_reason(call, 10) == "length"
    call = api.parse_completion({"model": "m", "prompt": [1] * 10, "max_tokens": 50}, lim)
    api.fit_to_context(call, 10, lim)
    assert call.max_tokens == 50


def test_vllms_sampling_fields_are_taken_and_null_means_the_default():
    c = api.parse_completion({"model": "m", "prompt": [1, 2], "stop": "\n", "top_k": 5,
                              "min_p": 0.1, "presence_penalty": 0, "frequency_penalty": 0.5,
                              "repetition_penalty": 1.1, "stop_token_ids": [2],
                              "min_tokens": 1, "user": None, "seed": None,
                              "temperature": None, "logprobs": None}, LIM)
    assert c.sampling == {"stop": ["\n"], "top_k": 5, "min_p": 0.1,
                          "frequency_penalty": 0.5, "repetition_penalty": 1.1,
                          "stop_token_ids": [2], "min_tokens": 1}
    assert c.seed == -1 and c.temperature == 1.0 and not c.logprobs
    e = _err(api.parse_completion, {"model": "m", "prompt": [1], "top_k": "x"})
    assert e.status == 400 and e.param == "top_k"


def test_chat_content_may_be_text_parts():
    c = api.parse_chat({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, LIM)
    assert c.messages == [{"role": "user", "content": "a\nb"}]
    e = _err(api.parse_chat, {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]})
    assert e.status == 400 and "messages[0]" in str(e)


def test_the_finish_reason_is_vllms_and_a_stop_string_ends_the_text():
    c = api.parse_completion({"model": "m", "prompt": [1], "max_tokens": 4, "stop": ["END"]},
                             LIM)
    assert api.finish_reason(c, 4, "stop") == "stop"       # EOS as the last allowed token
    assert api.finish_reason(c, 4) == "length" and api.finish_reason(c, 2) == "stop"
    assert api.cut_at_stop("abc END def", c, "stop") == "abc "
    assert api.cut_at_stop("abc END def", c, "length") == "abc END def"


def test_the_stop_token_that_ended_an_answer_is_not_in_its_text():
    c = api.parse_completion({"model": "m", "prompt": [1], "stop_token_ids": [9]}, LIM)
    assert api.text_ids(c, [5, 6, 9], "stop") == [5, 6]
    assert api.text_ids(c, [5, 6, 9], "length") == [5, 6, 9]
    assert api.text_ids(c, [5, 6, 7], "stop") == [5, 6, 7]      # EOS or a stop string


def test_a_batch_of_prompts_is_parsed_prompt_by_prompt_and_answered_whole():
    c = api.parse_completion({"model": "m", "prompt": [[1, 2], "hi", [3]]}, LIM)
    assert c.batch == [[1, 2], "hi", [3]] and c.prompt_ids is None
    e = _err(api.parse_completion, {"model": "m", "prompt": [[1], [1] * 101]})
    assert e.status == 400 and "101" in str(e)                   # each prompt is bounded
    e = _err(api.parse_completion, {"model": "m", "prompt": [[1]] * 65})
    assert e.status == 400 and "65 prompts" in str(e)
    e = _err(api.parse_completion, {"model": "m", "prompt": [[1], [2]], "stream": True})
    assert e.status == 400 and e.param == "stream"
    one = {"id": "x", "object": "text_completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "text": "a"}],
           "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
    b = api.batch_answer([one, {**one, "choices": [{"index": 0, "text": "b"}]}])
    assert [(c["index"], c["text"]) for c in b["choices"]] == [(0, "a"), (1, "b")]
    assert b["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}


def test_top_logprobs_are_asked_of_the_instances_and_shaped_as_vllms():
    c = api.parse_completion({"model": "m", "prompt": [1], "logprobs": 2}, LIM)
    assert c.logprobs and c.top_logprobs == 2 and c.sampling["logprobs"] == 2
    # The instance lists the sampled token first, then the top 2 (here it is not
    # among them, so 3 entries); completions show the first N + 1, as text.
    tops = [(["x", "y", "z"], (-2.0, -0.1, -0.3)), (["b", "c"], (-0.2, -float("inf")))]
    lp = api.logprobs(c, ["x", " b"], [-2.0, -0.2], tops)
    assert lp == {"text_offset": [0, 1], "token_logprobs": [-2.0, -0.2],
                  "tokens": ["x", " b"],
                  "top_logprobs": [{"x": -2.0, "y": -0.1, "z": -0.3},
                                   {"b": -0.2, "c": -9999.0}]}
    assert api.logprobs(c, ["q"], [-1.0], [None], offset=7)["text_offset"] == [7]
    # Chat: logprobs true + top_logprobs N: each token with its UTF-8 bytes and the
    # first N entries.
    ch = api.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                         "logprobs": True, "top_logprobs": 1}, LIM)
    assert ch.sampling["logprobs"] == 1
    lp = api.logprobs(ch, ["é"], [-0.5], [(["é", "e"], (-0.5, -1.5))])
    assert lp == {"content": [{"token": "é", "logprob": -0.5, "bytes": [195, 169],
                               "top_logprobs": [{"token": "é", "logprob": -0.5,
                                                 "bytes": [195, 169]}]}]}
    plain = api.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                            "logprobs": True}, LIM)
    assert plain.sampling["logprobs"] == 0
    assert api.logprobs(plain, ["a"], [-1.0], [(["a"], (-1.0,))])["content"][0][
        "top_logprobs"] == []
    e = _err(api.parse_chat, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2})
    assert e.param == "top_logprobs"
    none = api.parse_completion({"model": "m", "prompt": [1]}, LIM)
    assert "logprobs" not in none.sampling and api.logprobs(none, [], [], []) is None


def test_n_choices_and_echo_parse_and_answer_as_vllms():
    e = _err(api.parse_completion, {"model": "m", "prompt": "hi", "n": 2, "temperature": 0})
    assert e.param == "n" and "greedy" in e.message          # vLLM's 400
    e = _err(api.parse_completion, {"model": "m", "prompt": "hi", "n": 2,
                                    "seed": 2 ** 63 - 1})
    assert e.param == "seed"
    c = api.parse_completion({"model": "m", "prompt": "hi", "n": 3, "echo": True}, LIM)
    assert c.n == 3 and c.echo and c.prompt_text == "hi"
    answers = [api.answer(c, "cmpl-1", f"hi{i}", [i, i], None, 4, "length")
               for i in range(3)]
    b = api.batch_answer(answers, one_prompt=True)
    assert [x["index"] for x in b["choices"]] == [0, 1, 2]
    assert [x["text"] for x in b["choices"]] == ["hi0", "hi1", "hi2"]
    # The prompt counted once, every choice's tokens.
    assert b["usage"] == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10}
    assert api.batch_answer(answers)["usage"]["prompt_tokens"] == 12   # three prompts


TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                         "parameters": {"type": "object", "properties": {
                                             "city": {"type": "string"}}}}}


def test_tools_go_to_the_chat_template_and_tool_turns_are_kept():
    c = api.parse_chat({"model": "m", "tools": [TOOL], "tool_choice": "none", "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}, LIM)
    assert c.tools == [TOOL]
    assert c.messages[1]["content"] == "" and c.messages[1]["tool_calls"][0]["id"] == "c1"
    assert c.messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    user = [{"role": "user", "content": "x"}]
    for body, param in [({"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
                        ({"tools": [TOOL], "tool_choice": {"type": "function"}},
                         "tool_choice"),
                        ({"tool_choice": "auto"}, "tool_choice"),
                        ({"tools": [TOOL]}, "tool_choice"),         # auto, as vLLM's
                        ({"tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
                        ({"tools": [{"type": "function"}]}, "tools"),
                        ({"tools": [TOOL] * 129}, "tools"),
                        ({"tools": []}, "tools")]:
        assert _err(api.parse_chat, {"model": "m", "messages": user, **body}).param == param
    e = _err(api.parse_chat, {"model": "m", "messages": [
        {"role": "user", "content": "x", "tool_call_id": "c1"}]})
    assert e.param == "messages[0]"


def test_logit_bias_is_passed_and_response_format_text_only():
    c = api.parse_completion({"model": "m", "prompt": [1], "logit_bias": {"5": -100},
                              "response_format": {"type": "text"}}, LIM)
    assert c.sampling["logit_bias"] == {"5": -100}
    e = _err(api.parse_completion, {"model": "m", "prompt": [1],
                                    "response_format": {"type": "json_object"}})
    assert e.param == "response_format"
    assert _err(api.parse_completion, {"model": "m", "prompt": [1],
                                       "logit_bias": {"a": 1}}).param == "logit_bias"
