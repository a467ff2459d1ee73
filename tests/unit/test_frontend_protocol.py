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
    ({"model": "m", "prompt": [1], "n": 2}, 400, "n"),
    ({"model": "m", "prompt": [1], "logprobs": 5}, 400, "logprobs"),
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
    a = api.answer(c, "cmpl-1", "ab", [5, 6], [-0.5, -1.0], 1, api.finish_reason(c, 2))
    assert a["object"] == "text_completion" and a["choices"][0]["finish_reason"] == "length"
    assert a["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -1.0]
    assert a["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    chat = api.parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]},
                          LIM)
    ch = api.chunk(chat, "chatcmpl-1", "a", [5], [-0.5], None, first=True)
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
