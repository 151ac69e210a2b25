"""The `LLM` API and `trtpaged generate` on the tiny engine dir (built by the builder)."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from runtime_helpers import hf_beams, hf_from_engine_dir, hf_greedy
from trtpaged import BeamSearchParams, GuidedDecodingParams, LLM, SamplingParams, StructuredOutputsParams
from trtpaged.cli import main
from trtpaged.errors import RequestError
from trtpaged.runtime import llm as llm_module


@pytest.fixture(scope="module")
def llm(tiny_engine_dir):
    return LLM(tiny_engine_dir, device="cpu")


def test_generate_text_and_token_prompts_match_hf(llm, tiny_engine_dir):
    hf = hf_from_engine_dir(tiny_engine_dir)
    prompts = ["hello there", [5, 6, 7, 8, 9, 10], "a much longer prompt that spans more than one block of sixteen"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    assert [o.prompt for o in outs] == [prompts[0], None, prompts[2]]
    assert outs[1].prompt_token_ids == prompts[1]
    eos = llm.manifest.eos_token_ids[0]
    for out in outs:
        expected = hf_greedy(hf, out.prompt_token_ids, 10, eos)
        completion = out.outputs[0]
        assert completion.token_ids == expected
        # an incomplete character at the end is left out (vLLM's rule)
        assert completion.text == llm.tokenizer.decode(expected, skip_special_tokens=True).rstrip("\ufffd")
        assert completion.finish_reason in ("stop", "length")


def test_vllm_prompt_dicts_and_the_model_keyword_give_the_same_outputs(llm, tiny_engine_dir):
    """What a vLLM script passes: LLM(model=...), {"prompt": text} and {"prompt_token_ids": ids}, alone or listed."""
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(["hello there", [5, 6, 7, 8]], greedy)]
    as_dicts = llm.generate([{"prompt": "hello there"}, {"prompt_token_ids": [5, 6, 7, 8]}], greedy)
    assert [o.outputs[0].token_ids for o in as_dicts] == plain
    assert [o.prompt for o in as_dicts] == ["hello there", None]
    assert llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, greedy)[0].outputs[0].token_ids == plain[1]
    for bad in ({"prompt": "x", "multi_modal_data": {}}, {}):
        with pytest.raises(RequestError, match="a prompt dict holds 'prompt'") as e:
            llm.generate([bad], greedy)
        assert e.value.field == "prompt"
    assert llm.get_tokenizer() is llm.tokenizer
    with LLM(model=tiny_engine_dir, device="cpu", warmup=False) as by_name:
        assert by_name.generate(["hello there"], greedy)[0].outputs[0].token_ids == plain[0]
    with pytest.raises(RequestError, match="must be a list of ints|list of ints"):
        llm.generate({"prompt_token_ids": [[5, 6], [7]]}, greedy)  # one dict is one prompt, not two
    with pytest.raises(TypeError, match="give the engine dir once"):
        LLM(tiny_engine_dir, engine=tiny_engine_dir)


def test_vllm_engine_arguments_set_what_they_mean_or_are_refused_naming_them(tiny_engine_dir, caplog):
    with caplog.at_level("WARNING"), LLM(tiny_engine_dir, device="cpu", warmup=False, max_model_len=128, max_num_seqs=4,
             max_num_batched_tokens=64,
             tensor_parallel_size=1, dtype="float", kv_cache_dtype="float32", enforce_eager=True,
             trust_remote_code=False, disable_log_stats=True, gpu_memory_utilization=0.9,
             swap_space=0.5) as llm:  # fmt: skip
        c = llm.config
        assert (c.max_seq_len, c.max_batch_size, c.max_num_tokens) == (128, 4, 64)
        assert c.num_host_blocks == (1 << 29) // llm.manifest.kv_bytes_per_block_per_rank > 0
    # a fraction of GPU memory sizes nothing here (on a CPU either): said, not silently ignored
    assert any("gpu_memory_utilization=0.9 has no effect" in r.getMessage() for r in caplog.records)
    for kwargs, words in [({"dtype": "bfloat16"}, "dtype: 'bfloat16', but the engine was built with 'float32'"),
                          ({"dtype": "half"}, "dtype: 'float16', but the engine was built with 'float32'"),  # vLLM's
                          ({"block_size": 32}, "block_size: 32, but the engine was built with 16"),
                          ({"tokenizer": "/elsewhere"}, "tokenizer: '/elsewhere'; an engine dir carries its own"),
                          ({"max_model_len": 100, "max_seq_len": 200}, "max_model_len: 100 and max_seq_len"),
                          ({"max_model_len": 10**6}, r"max_model_len: must be an integer in \[1, 512\]"),
                          ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization: expected a fraction in \(0, 1\]"),
                          ({"seed": -1}, r"seed: expected an integer in \[0, 2\*\*63\)")]:  # fmt: skip
        with pytest.raises(ValueError, match=words):
            LLM(tiny_engine_dir, device="cpu", warmup=False, **kwargs)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['pipeline_parallel_size'\]"):
        LLM(tiny_engine_dir, device="cpu", warmup=False, pipeline_parallel_size=2)


def test_the_seed_argument_makes_unseeded_sampling_repeat(tiny_engine_dir):
    """vLLM's LLM(seed=...): requests without a seed of their own draw the same tokens in every run."""
    def draws(**seed):
        with LLM(tiny_engine_dir, device="cpu", warmup=False, **seed) as llm:
            outs = llm.generate(["a", "b"], SamplingParams(max_tokens=8, temperature=1.0, n=2, ignore_eos=True))
            return [c.token_ids for o in outs for c in o.outputs]

    first = draws(seed=5)
    assert draws(seed=5) == first and draws(seed=6) != first
    torch.manual_seed(123)  # what the process drew before must not matter: vLLM V1's default seed is 0
    assert draws() == draws(seed=0)
    torch.manual_seed(123)
    assert draws(seed=None) != draws(seed=None)  # None: the RNGs left as they are, drawing on


def test_max_tokens_past_the_room_left_is_cut_to_it_offline(llm, tiny_engine_dir):
    """vLLM's offline API runs such a request to max_model_len ("length"); it was refused, and with it the batch."""
    hf = hf_from_engine_dir(tiny_engine_dir)
    long_prompt = [(7 * i) % 250 + 3 for i in range(llm.config.max_seq_len - 5)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, min_tokens=10)
    short, cut = llm.generate([[5, 6, 7], long_prompt], params)
    assert len(short.outputs[0].token_ids) == 64
    assert cut.outputs[0].token_ids == hf_greedy(hf, long_prompt, 5, None) and cut.outputs[0].finish_reason == "length"
    with pytest.raises(RequestError, match="prompt: 512 tokens reaches max_seq_len") as refused:
        llm.generate([[5] * llm.config.max_seq_len], params)
    assert refused.value.field == "prompt" and llm.engine.kv.pool.num_used == 0


def test_generate_takes_vllms_call_options(llm):
    finished = []

    class Bar:  # use_tqdm's other form: the tqdm-like class to use
        def __init__(self, total, desc):
            self.total = total

        def update(self, n):
            finished.append(n)

        def close(self):
            finished.append("closed")

    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    with_bar = llm.generate(["a", "b", "c"], greedy, use_tqdm=Bar)
    assert finished == [1, 1, 1, "closed"]
    assert [o.outputs[0].token_ids for o in llm.generate(["a", "b", "c"], greedy, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in with_bar]  # fmt: skip
    with pytest.raises(ValueError, match="lora_request: trtpaged serves no LoRA adapters"):
        llm.generate(["a"], greedy, lora_request=object())
    salted = llm.generate({"prompt_token_ids": list(range(100, 150)), "cache_salt": "tenant-z"}, greedy)[0]
    again = llm.generate({"prompt_token_ids": list(range(100, 150)), "cache_salt": "tenant-z"}, greedy)[0]
    other = llm.generate({"prompt_token_ids": list(range(100, 150)), "cache_salt": "tenant-y"}, greedy)[0]
    assert (salted.num_cached_tokens, again.num_cached_tokens, other.num_cached_tokens) == (0, 48, 0)


def test_the_engine_takes_vllms_prompt_dicts_as_generate_does(llm):
    """LLMEngine.add_request({"prompt_token_ids": ...}) iterated the dict's keys ("a token-id prompt must be a list
    of ints"), though LLM.generate and vLLM's engine take TokensPrompt / TextPrompt dicts."""
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    ids = list(range(200, 250))
    truth = llm.generate([ids, "hello there"], greedy, use_tqdm=False)
    engine = llm.engine

    def run(prompt, params=greedy) -> list:
        request_id = engine.add_request(prompt, params)
        outs = {}
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        return outs[request_id]

    assert run({"prompt_token_ids": ids}).outputs[0].token_ids == truth[0].outputs[0].token_ids
    assert run({"prompt": "hello there"}).outputs[0].token_ids == truth[1].outputs[0].token_ids
    # a dict's cache_salt is the request's: another salt finds none of the 48 cached tokens, the same salt all
    assert [run({"prompt_token_ids": ids, "cache_salt": salt}).num_cached_tokens for salt in ("t-a", "t-a", "t-b")] \
        == [0, 48, 0]  # fmt: skip
    salted = dataclasses.replace(greedy, cache_salt="t-z")  # the dict's salt wins, as in LLM.generate
    assert run({"prompt_token_ids": ids, "cache_salt": "t-a"}, salted).num_cached_tokens == 48
    assert llm.generate({"prompt_token_ids": ids, "cache_salt": "t-b"}, salted)[0].num_cached_tokens == 48
    with pytest.raises(RequestError, match="a prompt dict holds 'prompt'"):
        engine.add_request({"text": "hi"}, greedy)


def test_chat_returns_a_list_with_the_templated_prompt_and_takes_a_template(llm):
    one = [{"role": "user", "content": "hi"}]
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    outs = llm.chat(one, greedy, use_tqdm=False)
    text = llm.tokenizer.apply_chat_template(one, add_generation_prompt=True, tokenize=False)
    assert len(outs) == 1 and outs[0].prompt == text
    assert outs[0].prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    (plain,) = llm.chat(one, greedy, chat_template="{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert plain.prompt == "[hi]" and plain.prompt_token_ids == llm.tokenizer.encode("[hi]", add_special_tokens=False)


def test_vllm_sampling_fields(llm, tiny_engine_dir):
    hf = hf_from_engine_dir(tiny_engine_dir)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = list(range(20, 60))
    (cut,) = llm.generate([prompt], dataclasses.replace(greedy, truncate_prompt_tokens=10))
    assert cut.prompt_token_ids == prompt[-10:] and cut.outputs[0].token_ids == hf_greedy(hf, prompt[-10:], 6, None)
    (plain,) = llm.generate([prompt], greedy)
    (bare,) = llm.generate([prompt], dataclasses.replace(greedy, detokenize=False))
    assert bare.outputs[0].token_ids == plain.outputs[0].token_ids
    assert plain.outputs[0].text and bare.outputs[0].text == ""
    choices = ["red", "green", "blue"]
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=8, temperature=1.0, n=3, seed=4,
                                                   guided_decoding=GuidedDecodingParams(choice=choices)))
    assert {c.text for o in outs for c in o.outputs} <= set(choices)
    assert SamplingParams.from_optional(n=None, max_tokens=4, temperature=None) == SamplingParams(max_tokens=4)
    assert greedy.clone() == greedy and greedy.clone() is not greedy
    for kwargs, field in [({"guided_decoding": GuidedDecodingParams(regex="a"),
                            "structured_outputs": StructuredOutputsParams(regex="b")}, "guided_decoding"),
                          ({"detokenize": False, "stop": ["x"]}, "stop"),
                          ({"best_of": 3}, "best_of"),
                          ({"logits_processors": [lambda ids, logits: logits]}, "logits_processors"),
                          ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")]:  # fmt: skip
        with pytest.raises(RequestError) as refused:
            SamplingParams(**kwargs)
        assert refused.value.field == field
    with pytest.raises(RequestError) as refused:
        GuidedDecodingParams(regex="a", backend="outlines")
    assert refused.value.field == "guided_decoding.backend"


def test_numpy_values_sample_as_the_python_values_they_hold(llm, tiny_engine_dir):
    """Values read out of NumPy arrays (np.float32, np.int64, np.bool_, an id array) were refused ("must be an
    integer, got np.int64(6)") where vLLM's SamplingParams takes them; a NaN or a non-integer stays refused."""

    hf = hf_from_engine_dir(tiny_engine_dir)
    prompt = list(range(30, 50))
    (greedy,) = llm.generate([prompt], SamplingParams(max_tokens=np.int64(6), temperature=np.float32(0.0),
                                                      ignore_eos=np.bool_(True)))  # fmt: skip
    assert greedy.outputs[0].token_ids == hf_greedy(hf, prompt, 6, None)
    plain = SamplingParams(max_tokens=5, temperature=0.7, top_p=0.75, seed=3, stop_token_ids=[7, 9],
                           logit_bias={11: 2.5}, allowed_token_ids=[7, 9, 11, 12, 13], ignore_eos=True)  # fmt: skip
    numpy = SamplingParams(max_tokens=np.int32(5), temperature=np.float64(0.7), top_p=np.float32(0.75),
                           seed=np.uint16(3), stop_token_ids=np.array([7, 9]),
                           logit_bias={np.int64(11): np.float32(2.5)},
                           allowed_token_ids=list(np.arange(11, 14)) + [7, 9], ignore_eos=True)  # fmt: skip
    assert numpy.stop_token_ids == (7, 9) and numpy.logit_bias == {11: 2.5} and type(numpy.seed) is int
    ours, theirs = llm.generate([prompt, prompt], [plain, numpy])
    assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
    for kwargs, field in [({"temperature": np.float32("nan")}, "temperature"), ({"max_tokens": np.float64(3)},
                                                                                "max_tokens")]:  # fmt: skip
        with pytest.raises(RequestError) as refused:
            SamplingParams(**kwargs)
        assert refused.value.field == field


def test_structured_outputs_params_takes_vllms_flags(llm):
    """vLLM's StructuredOutputsParams(json=..., disable_any_whitespace=True) was a TypeError (an unexpected
    argument); the flags are taken, and the JSON has no free whitespace: xgrammar's any_whitespace=False form (one
    space after ':' and ','), which vLLM's xgrammar backend compiles for disable_any_whitespace=True."""
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    compact = StructuredOutputsParams(json=schema, disable_any_whitespace=True, disable_fallback=True,
                                      disable_additional_properties=False)  # fmt: skip
    outs = llm.generate(["a", "b"], SamplingParams(max_tokens=20, temperature=1.0, n=3, seed=2,
                                                   structured_outputs=compact))  # fmt: skip
    assert {c.text for o in outs for c in o.outputs} <= {'{"a": "x"}', '{"a": "y"}'}
    for kwargs, field in [({"whitespace_pattern": r"[ ]?"}, "structured_outputs.whitespace_pattern"),
                          ({"disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace")]:
        with pytest.raises(RequestError) as refused:
            StructuredOutputsParams(json=schema, **kwargs)
        assert refused.value.field == field


def test_logprobs_minus_one_is_the_whole_vocabulary(tiny_engine_dir):
    with LLM(tiny_engine_dir, device="cpu", warmup=False, max_logprobs=-1) as everything:
        (out,) = everything.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0, logprobs=-1,
                                                                 prompt_logprobs=-1))  # fmt: skip
        vocab = everything.manifest.dims.vocab_size
        assert [len(entry) for entry in out.outputs[0].logprobs] == [vocab, vocab]
        assert [len(entry) for entry in out.prompt_logprobs[1:]] == [vocab, vocab]
    with LLM(tiny_engine_dir, device="cpu", warmup=False) as capped, pytest.raises(RequestError) as refused:
        capped.generate([[5, 6, 7]], SamplingParams(max_tokens=2, logprobs=-1))
    assert refused.value.field == "logprobs" and "exceeds max_logprobs (20)" in str(refused.value)


def test_vllm_beam_search_call_gives_hfs_beams_with_the_prompt_in_front(llm, tiny_engine_dir):
    hf = hf_from_engine_dir(tiny_engine_dir)
    eos = llm.manifest.eos_token_ids[0]
    prompts = [[9, 30, 41, 7, 80], [99, 297, 64, 203, 49, 192, 62], [216, 75, 219, 155, 184, 46]]  # 2 with EOS beams
    for keep_end in (False, True):
        params = BeamSearchParams(beam_width=3, max_tokens=12, include_stop_str_in_output=keep_end)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        for prompt, out in zip(prompts, outs):
            truth = hf_beams(hf, prompt, 12, 3, eos)  # an ended beam keeps its EOS, as vLLM's offline beam_search
            assert [s.tokens[len(prompt):] for s in out.sequences] == truth
            for seq, t in zip(out.sequences, truth):
                assert seq.tokens[: len(prompt)] == prompt and seq.text == llm.tokenizer.decode(seq.tokens)
                assert seq.finish_reason == ("stop" if t[-1] == eos else "length") and seq.cum_logprob < 0
                assert seq.stop_reason == (eos if t[-1] == eos else None)
    assert any(t[-1] == eos for p in prompts for t in hf_beams(hf, p, 12, 3, eos)), "no beam ended: EOS untested"
    (numpy_sized,) = llm.beam_search([prompts[0]], BeamSearchParams(beam_width=np.int64(3), max_tokens=np.int32(12)))
    assert [s.tokens[len(prompts[0]):] for s in numpy_sized.sequences] == hf_beams(hf, prompts[0], 12, 3, eos)
    with pytest.raises(RequestError, match="temperature"):
        llm.beam_search([[1, 2]], BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7))
    with pytest.raises(RequestError) as refused:
        BeamSearchParams(beam_width=0, max_tokens=4)
    assert refused.value.field == "beam_width"


def test_beam_search_of_one_beam_scores_it_as_hf_does(llm, tiny_engine_dir):
    """BeamSearchParams(beam_width=1), which vLLM takes, returned cum_logprob None; it is the greedy sequence's
    sum of log-probs under HF's model."""
    hf = hf_from_engine_dir(tiny_engine_dir)
    prompt = [9, 30, 41, 7, 80]
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=6))
    (seq,) = out.sequences
    generated = hf_greedy(hf, prompt, 6, llm.manifest.eos_token_ids[0])
    assert seq.tokens == prompt + generated and seq.logprobs == []
    with torch.no_grad():
        logprobs = hf.model(torch.tensor([seq.tokens])).logits[0].log_softmax(-1)
    assert seq.cum_logprob == pytest.approx(sum(logprobs[len(prompt) - 1 + i, t].item()
                                                for i, t in enumerate(generated)), abs=1e-3)  # fmt: skip


def test_sampling_params_change_as_in_vllms_examples(llm):
    """vLLM's basic/generate.py sets fields on get_default_sampling_params(); a request keeps the values it was
    given even when the caller changes them afterwards; guided_decoding reads back."""
    sp = llm.get_default_sampling_params()
    sp.max_tokens, sp.temperature = 5, 0.0
    (out,) = llm.generate(["hello"], sp)
    assert len(out.outputs[0].token_ids) <= 5
    request = llm.engine.add_request([5, 6, 7], sp)
    sp.max_tokens = 1
    while llm.engine.has_unfinished():
        finished = [o for o in llm.engine.step() if o.finished and o.request_id == request]
    assert len(finished[0].outputs[0].token_ids) in range(2, 6)
    guided = GuidedDecodingParams(choice=["yes", "no"])
    sp = SamplingParams(guided_decoding=guided)
    assert sp.guided_decoding is guided
    sp.guided_decoding = GuidedDecodingParams(choice=["maybe"])  # set again: the new one is the grammar
    assert dataclasses.replace(sp).structured_outputs.choice == ("maybe",)
    with pytest.raises(TypeError, match="vLLM's request_id, prompt, params"):
        llm.engine.add_request("hello", "r1")


def test_vllms_llm_engine_example_loop_runs_and_matches_hf(llm, tiny_engine_dir):
    """vLLM's offline_inference/llm_engine_example.py: add_request(request_id, prompt, params) in vLLM's order,
    has_unfinished_requests() and abort_request([ids]) (each was a TypeError or AttributeError); the greedy
    request's tokens are HF's."""
    engine = llm.llm_engine
    hf = hf_from_engine_dir(tiny_engine_dir)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    test_prompts = [([5, 6, 7, 8], greedy), ("hello there", SamplingParams(max_tokens=4, temperature=0.8, seed=1)),
                    ([9, 10, 11], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))]  # fmt: skip
    finished, request_id = {}, 0
    while test_prompts or engine.has_unfinished_requests():
        if test_prompts:
            prompt, sampling_params = test_prompts.pop(0)
            engine.add_request(str(request_id), prompt, sampling_params)
            request_id += 1
            if request_id == 3:
                assert engine.get_num_unfinished_requests() == 3 - len(finished)
                engine.abort_request(["2"])  # vLLM V1 takes a list of ids
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["0", "1"] and engine.get_num_unfinished_requests() == 0
    assert finished["0"].outputs[0].token_ids == hf_greedy(hf, [5, 6, 7, 8], 8, llm.manifest.eos_token_ids[0])
    assert finished["1"].prompt == "hello there" and engine.get_tokenizer() is llm.tokenizer
    with pytest.raises(RequestError, match="request_id: must be a string"):
        engine.add_request(7, "hello", greedy)


def test_limits_come_from_the_manifest_and_only_tighten(llm, tiny_engine_dir):
    assert llm.stats()["kv_blocks_total"] == llm.manifest.kv_cache.num_kv_blocks == llm.config.num_kv_blocks
    assert llm.engine.runner.num_kv_blocks == llm.config.num_kv_blocks
    with pytest.raises(ValueError, match=r"max_num_tokens: must be in \[1, 256\]"):
        LLM(tiny_engine_dir, max_num_tokens=100000)


def test_stats_report_peaks_of_the_run(llm):
    """After a run nothing is held: the peaks say what the run used and what sharing saved."""
    prompt = list(range(3, 43))  # 40 tokens: 3 blocks of 16
    llm.generate([prompt], SamplingParams(max_tokens=3, n=3, temperature=1.0, seed=0, ignore_eos=True))
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["kv_utilisation"] == 0.0
    assert stats["kv_blocks_saved_by_sharing_peak"] >= 3 * 2  # 3 prompt blocks shared by 2 more samples
    assert stats["kv_blocks_used_peak"] >= 3


def test_phase_seconds_cover_every_phase(llm):
    before = dict(llm.engine.phase_seconds)
    llm.generate(["hello there"], SamplingParams(max_tokens=4, temperature=0.0))
    after = llm.engine.phase_seconds
    assert set(after) == {"schedule", "prepare", "model", "sample", "update", "output"}
    assert all(after[k] > before[k] for k in after)


def test_output_kinds_delta_and_final_only_reassemble_the_cumulative_output(llm):
    from trtpaged.runtime.outputs import RequestOutputKind

    prompt = "tell me a story"
    base = dict(max_tokens=16, temperature=1.0, seed=7, n=2, ignore_eos=True)
    free_run = llm.generate(prompt, SamplingParams(**base))[0].outputs[0].text
    assert len(free_run) >= 8
    stop = free_run[4:7]  # spans several byte tokens: a delta must never show a part of it
    outputs = {}
    for kind in RequestOutputKind:
        request_id = llm.engine.add_request(prompt, SamplingParams(**base, stop=[stop], output_kind=kind))
        outputs[kind] = []
        while llm.engine.has_unfinished():
            outputs[kind] += [o for o in llm.engine.step() if o.request_id == request_id]
    cumulative = outputs[RequestOutputKind.CUMULATIVE][-1]
    assert cumulative.outputs[0].finish_reason == "stop" and stop not in cumulative.outputs[0].text
    assert all(cumulative.outputs[0].text.startswith(o.outputs[0].text)
               for o in outputs[RequestOutputKind.CUMULATIVE])  # fmt: skip
    final_only = outputs[RequestOutputKind.FINAL_ONLY]
    assert len(final_only) == 1 and final_only[0].finished
    assert [c.text for c in final_only[0].outputs] == [c.text for c in cumulative.outputs]
    texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
    for out in outputs[RequestOutputKind.DELTA]:
        for c in out.outputs:
            texts[c.index] += c.text
            tokens[c.index] += c.token_ids
    assert [texts[i] for i in (0, 1)] == [c.text for c in cumulative.outputs]
    assert [tokens[i] for i in (0, 1)] == [c.token_ids for c in cumulative.outputs]


def test_delta_stream_interval_hands_over_every_nth_token(llm):
    """stream_interval N: the first token at once, then N tokens per output, the end at once; joined, the
    deltas are the one-token-per-step run's tokens and text (n=2: each sample keeps its own count)."""
    from trtpaged.errors import RequestError
    from trtpaged.runtime.outputs import RequestOutputKind

    base = dict(max_tokens=11, temperature=1.0, seed=3, n=2, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    def run(interval):
        request_id = llm.engine.add_request("tell me a story", SamplingParams(**base, stream_interval=interval))
        counts, tokens, texts = {0: [], 1: []}, {0: [], 1: []}, {0: "", 1: ""}
        while llm.engine.has_unfinished():
            for out in llm.engine.step():
                for c in out.outputs if out.request_id == request_id else ():
                    counts[c.index].append(len(c.token_ids))
                    tokens[c.index] += c.token_ids
                    texts[c.index] += c.text
        return counts, tokens, texts

    one, four = run(1), run(4)
    assert one[0] == {0: [1] * 11, 1: [1] * 11}
    assert four[0] == {0: [1, 4, 4, 2], 1: [1, 4, 4, 2]}
    assert four[1:] == one[1:] and len(one[1][0]) == 11
    with pytest.raises(RequestError, match="stream_interval: must be >= 1"):
        SamplingParams(stream_interval=0)


def test_delta_holds_back_only_what_could_start_a_stop_string(llm):
    """A stop string the text never starts holds nothing back: each step's delta is the one without stops.
    One the text does start is held until the text moves past it."""
    from trtpaged.runtime.outputs import RequestOutputKind

    prompt = "tell me a story"
    base = dict(max_tokens=16, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    def deltas(**extra):
        request_id = llm.engine.add_request(prompt, SamplingParams(**base, **extra))
        steps = []
        while llm.engine.has_unfinished():
            steps += [o.outputs[0].text for o in llm.engine.step() if o.request_id == request_id and o.outputs]
        return steps

    free = deltas()
    text = "".join(free)
    absent = "\x00" + text[:2]  # begins with a character the text never has
    assert absent[0] not in text and deltas(stop=[absent]) == free
    first = text[0] + "\x00"  # the text starts it at once, then moves past it
    held = deltas(stop=[first])
    assert "".join(held) == text and held[0] == "" and held != free


def test_chat_takes_one_conversation_or_a_batch(llm):
    params = SamplingParams(max_tokens=6, temperature=0.0)
    one = [{"role": "user", "content": "hi"}]
    two = [{"role": "user", "content": "what is 2 + 2?"}]
    (single,) = llm.chat(one, params)  # a list of one, as vLLM's
    batch = llm.chat([one, two], params)
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0].outputs[0].token_ids == single.outputs[0].token_ids
    assert batch[1].prompt_token_ids == llm.chat_prompt(two)


def test_chat_without_a_template_names_it(llm):
    """An engine whose tokenizer has no chat template: chat is refused naming chat_template and the ways out (was:
    transformers' message about its own default templates); a template given with the call still works."""
    template, llm.tokenizer.chat_template = llm.tokenizer.chat_template, None
    try:
        with pytest.raises(RequestError, match="no chat template") as refused:
            llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))
        assert refused.value.field == "chat_template"
        (out,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2),
                          chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
        assert out.prompt == "hi"
    finally:
        llm.tokenizer.chat_template = template


def test_chat_names_an_empty_conversation_and_a_bad_character_where_it_is(llm):
    """No messages (was: transformers' bare ValueError), and a lone surrogate named by its message and its place
    in that message's content (was: its place in the rendered template)."""
    with pytest.raises(RequestError, match="at least one message") as refused:
        llm.chat([], SamplingParams(max_tokens=2))
    assert refused.value.field == "messages"
    bad = [{"role": "user", "content": "ok"}, {"role": "user", "content": "abc\ud800"}]
    with pytest.raises(RequestError, match=r"character 3, '\\ud800'") as refused:
        llm.chat(bad, SamplingParams(max_tokens=2))
    assert refused.value.field == "messages[1].content"


def test_chat_names_a_malformed_message_and_takes_an_empty_assistant_turn(llm):
    """A message without a role, or with content that is neither text nor parts, is named (was: jinja2's bare
    UndefinedError out of the template); content None (an assistant turn that only called tools) is empty text,
    as vLLM gives it; an error the template raises itself is a RequestError on messages."""
    for bad, field in (([{"content": "hi"}], "messages[0].role"),
                       ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], "messages[1].content")):
        with pytest.raises(RequestError) as refused:
            llm.chat(bad, SamplingParams(max_tokens=2))
        assert refused.value.field == field
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}, {"role": "user", "content": "b"}]
    got = llm.chat(turns, SamplingParams(max_tokens=2))[0]
    empty = [{**t, "content": t["content"] or ""} for t in turns]
    assert got.prompt == llm.tokenizer.apply_chat_template(empty, add_generation_prompt=True, tokenize=False)
    strict = "{% if messages|length > 1 %}{{ raise_exception('one message only') }}{% endif %}{{ messages[0].content }}"
    with pytest.raises(RequestError, match="one message only") as refused:
        llm.chat(turns, SamplingParams(max_tokens=2), chat_template=strict)
    assert refused.value.field == "messages"
    with pytest.raises(RequestError, match="not a valid template") as refused:  # the caller's own template
        llm.chat(turns, SamplingParams(max_tokens=2), chat_template="{% for m in messages %}{{ m.content }")
    assert refused.value.field == "chat_template"


def test_a_chat_template_that_loops_without_end_is_stopped_at_its_deadline(llm, monkeypatch):
    """An engine whose own template loops for hours (two nested range(100000), as a hostile engine dir may hold)
    is stopped once rendering passes CHAT_TEMPLATE_SECONDS: a RequestError on messages (was: the call never
    returned, its memory growing by ~100 MB/s); the next chat renders and runs as before, no block in use."""
    monkeypatch.setattr(llm_module, "CHAT_TEMPLATE_SECONDS", 0.5)
    one = [{"role": "user", "content": "hi"}]
    (before,) = llm.chat(one, SamplingParams(max_tokens=3, temperature=0))
    template = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    try:
        start = time.monotonic()
        with pytest.raises(RequestError, match="ran past 0.5 s") as refused:
            llm.chat(one, SamplingParams(max_tokens=2))
        assert refused.value.field == "messages" and time.monotonic() - start < 5
    finally:
        llm.tokenizer.chat_template = template
    (after,) = llm.chat(one, SamplingParams(max_tokens=3, temperature=0))
    assert after.prompt == before.prompt and after.outputs[0].token_ids == before.outputs[0].token_ids
    assert llm.engine.stats()["kv_blocks_used"] == 0


def _text_of(tokenizer, token_ids, stop=()) -> tuple[str, str | None]:
    """The independent truth for a finished output's text: the whole ids decoded, less an incomplete character at
    the end (vLLM's text leaves it out), cut before the first stop string; and that stop string."""
    text = tokenizer.decode(token_ids, skip_special_tokens=True).rstrip("\ufffd")
    hits = [(text.find(s), s) for s in stop if s in text]
    if not hits:
        return text, None
    index, first = min(hits)
    return text[:index], first


def test_an_output_cut_inside_a_character_leaves_it_out(llm):
    """Every byte is a token in the tiny tokenizer: an output that ends inside a character's bytes (forced by
    logit_bias) ends its text before that character, as vLLM's does; its token ids keep every byte."""
    tok = llm.tokenizer
    a, (first, second, _) = tok.encode("a")[0], tok.encode("世")
    for bias, max_tokens in (({first: 100.0}, 1), ({a: 100.0}, 3), ({first: 100.0}, 2), ({second: 100.0}, 2)):
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=max_tokens, logit_bias=bias, ignore_eos=True))
        c = out.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == max_tokens
        assert c.text == _text_of(tok, c.token_ids)[0] and "\ufffd" not in c.text[-1:], (bias, c.text)
    # beams (decoded whole): 4 beams of 6 byte tokens of a random model, some of them ending inside a character
    (beams,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, beam_width=4, n=4, ignore_eos=True))
    assert [c.text for c in beams.outputs] == [_text_of(tok, c.token_ids)[0] for c in beams.outputs]


@pytest.mark.slow
def test_text_held_back_at_the_end_is_checked_for_stop_strings(smollm2_int4_engine_dir):
    """SmolLM2's first answer token to an emoji list is a space and an emoji's first bytes: with max_tokens 1 the
    space is the whole text (the incomplete emoji left out), and a stop string " " must cut it (was: the held-back
    text was released at the finish without the stop-string check, and the answer held the stop string)."""
    llm = LLM(smollm2_int4_engine_dir, device="cpu", num_kv_blocks=64)
    prompt = "Emoji list: \U0001F600 \U0001F603 \U0001F604"
    for max_tokens, stop in ((1, [" "]), (1, []), (3, []), (3, ["\ufffd"]), (5, [" "])):
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop))
        c = out.outputs[0]
        text, hit = _text_of(llm.tokenizer, c.token_ids, stop)
        assert (c.text, c.stop_reason) == (text, hit), (max_tokens, stop, c.text, c.token_ids)
        assert c.finish_reason == ("stop" if hit else "length")
    # the emoji's last bytes as a stop token id: the text held back until it ends the output is checked too,
    # whether the end token's text is shown or not (its own text completes no stop string)
    (first, end_token) = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))[0].outputs[0].token_ids
    for include in (False, True):
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, stop=[" "], stop_token_ids=[
            end_token], include_stop_str_in_output=include))
        c = out.outputs[0]
        text, hit = _text_of(llm.tokenizer, [first, end_token], [" "])
        assert (c.text, c.stop_reason, c.finish_reason) == (text + hit * include, hit, "stop"), (include, c)
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[end_token],
                                                       include_stop_str_in_output=include))
        shown = [first, end_token] if include else [first]
        assert (out.outputs[0].text, out.outputs[0].stop_reason) == (_text_of(llm.tokenizer, shown)[0], end_token)


@pytest.mark.slow
def test_a_stop_string_within_min_tokens_stays_text_when_held_back_text_ends_the_output(smollm2_int4_engine_dir):
    """The output processor over SmolLM2's tokenizer: "x", then a space with an emoji's first bytes (held back),
    then EOS shown as the stop token. "x" came within min_tokens, so it is text, not a stop, however the end token's
    text is shown (a first version of the held-back check searched back into it: text "x", stop "x")."""
    from transformers import AutoTokenizer

    from trtpaged.runtime.output_processor import OutputProcessor
    from trtpaged.runtime.sequence import Sequence, SequenceGroup

    tok = AutoTokenizer.from_pretrained(smollm2_int4_engine_dir / "tokenizer")
    held, x, eos = tok.encode(" \U0001F60F")[0], tok.encode("x")[0], tok.eos_token_id
    assert tok.decode([held]).endswith("\ufffd")  # a space and the emoji's first bytes: its text waits
    for include in (True, False):
        seq = Sequence(1, tok.encode("Hi"))
        group = SequenceGroup("r", 0, None, seq, SamplingParams(stop=["x"], min_tokens=2, stop_token_ids=[eos],
                                                                include_stop_str_in_output=include))
        for token in (x, held, eos):
            seq.append_token(token)
        seq.finish("stop", eos)
        assert OutputProcessor(tok).detokenize([group]) == []
        assert (seq.output_text, seq.stop_reason) == (_text_of(tok, [x, held])[0], eos), include


def test_reset_prefix_cache_forgets_cached_blocks_only_when_nothing_runs(llm, tiny_engine_dir):
    """vLLM's LLM.reset_prefix_cache: a prompt of 3 full blocks hits its 48 tokens, after a reset none (and the
    answer is still HF's); while a request is unfinished the reset is refused and changes nothing."""
    hf = hf_from_engine_dir(tiny_engine_dir)
    prompt = list(range(200, 250))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    truth = hf_greedy(hf, prompt, 4, None)
    assert llm.reset_prefix_cache() is True
    assert llm.stats()["kv_blocks_cached"] == 0
    cached = []
    for reset in (False, False, True, False):
        if reset:
            assert llm.reset_prefix_cache() is True
            stats = llm.stats()
            assert stats["kv_blocks_cached"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
        (out,) = llm.generate([prompt], greedy)
        assert out.outputs[0].token_ids == truth
        cached.append(out.num_cached_tokens)
    assert cached == [0, 48, 0, 48]
    request = llm.engine.add_request(prompt, greedy)
    llm.engine.step()
    before = llm.stats()["kv_blocks_cached"]
    assert llm.reset_prefix_cache() is False and llm.reset_prefix_cache(reset_running_requests=True) is False
    assert llm.stats()["kv_blocks_cached"] == before > 0
    while llm.engine.has_unfinished():
        for o in llm.engine.step():
            if o.request_id == request and o.finished:
                assert o.outputs[0].token_ids == truth and o.num_cached_tokens == 48
    assert llm.reset_prefix_cache() is True


def test_cache_salt_shares_prefix_blocks_only_under_the_same_salt(llm, tiny_engine_dir):
    """LLM.generate with SamplingParams.cache_salt (vLLM's): a 50-token prompt (3 full blocks of 16) finds its 48
    cached tokens again under the same salt (or none, as before) and none under any other salt; the outputs are
    HF's greedy ones whatever the salt."""
    hf = hf_from_engine_dir(tiny_engine_dir)
    prompt = list(range(100, 150))
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    truth = hf_greedy(hf, prompt, 4, None)
    cached = []
    for salt in (None, None, "tenant-a", "tenant-a", "tenant-b", None, "tenant-b"):
        hits = llm.stats()["prefix_cache_hits_tokens"]
        (out,) = llm.generate([prompt], dataclasses.replace(greedy, cache_salt=salt))
        assert out.outputs[0].token_ids == truth
        assert llm.stats()["prefix_cache_hits_tokens"] - hits == out.num_cached_tokens
        cached.append(out.num_cached_tokens)
    assert cached == [0, 48, 0, 48, 0, 48, 48]
    for bad, words in (("", "1 to 128 characters"), ("x" * 129, "1 to 128 characters"), (7, "int"),
                       ("\ud800", "not valid Unicode")):  # fmt: skip
        with pytest.raises(RequestError, match=f"cache_salt: .*{words}") as refused:
            SamplingParams(cache_salt=bad)
        assert refused.value.field == "cache_salt"


def test_refusal_names_the_limit(llm):
    with pytest.raises(ValueError, match="max_seq_len"):
        llm.generate([[1] * (llm.config.max_seq_len + 1)])


def test_cli_generate_streams_what_the_api_generates(llm, tiny_engine_dir):
    (greedy,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=6, temperature=0.0))
    result = CliRunner().invoke(main, ["generate", str(tiny_engine_dir), "--prompt", "hi", "--max-tokens", "6",
                                       "--chat"])
    assert result.exit_code == 0, result.output
    assert result.stdout == greedy.outputs[0].text + "\n"
    sampled = llm.generate("hi", SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=3))[0]
    result = CliRunner().invoke(
        main, ["generate", str(tiny_engine_dir), "--prompt", "hi", "--max-tokens", "4", "--n", "2",
               "--temperature", "1", "--seed", "3"]
    )
    assert result.exit_code == 0, result.output
    expected = "".join(f"--- [{c.index}] ({c.finish_reason})\n{c.text}\n" for c in sampled.outputs)
    assert result.stdout == expected
    beams = llm.generate("hi", SamplingParams(max_tokens=4, beam_width=3, n=3, temperature=0.0))[0]
    result = CliRunner().invoke(main, ["generate", str(tiny_engine_dir), "--prompt", "hi", "--beam-width", "3",
                                       "--max-tokens", "4"])  # fmt: skip
    assert result.exit_code == 0, result.output  # every beam, best first, as vLLM's beam_search returns them
    assert result.stdout == "".join(f"--- [{c.index}] ({c.finish_reason})\n{c.text}\n" for c in beams.outputs)
    result = CliRunner().invoke(main, ["generate", str(tiny_engine_dir), "--prompt", "hi", "--beam-width", "3",
                                       "--n", "1", "--max-tokens", "4"])  # fmt: skip
    assert result.exit_code == 0 and result.stdout.count("--- [") == 1


@pytest.mark.parametrize("what", ["completion", "inspect"])
@pytest.mark.parametrize("stdout, words", [("full", "cannot write {} to stdout (No space left on device)"),
                                           ("closed", "stdout is closed: nowhere to write {}")])
def test_cli_says_when_stdout_cannot_take_the_results(tiny_engine_dir, what, stdout, words):
    """A full disk was an OSError traceback (generate, inspect); a closed stdout (>&-) exited 0 with the output lost."""
    import subprocess
    import sys

    if what == "completion":
        args, words = ["generate", str(tiny_engine_dir), "--prompt", "hi", "--max-tokens", "4", "--device", "cpu"], \
            words.format("the completion")
    else:
        args, words = ["inspect", str(tiny_engine_dir)], words.format("the results")
    command = [sys.executable, "-m", "trtpaged.cli", *args]
    if stdout == "full":
        with open("/dev/full", "w") as full:
            out = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, timeout=120)
    else:
        out = subprocess.run(["bash", "-c", '"$@" >&-', "cli", *command], stderr=subprocess.PIPE, timeout=120)
    assert out.returncode == 1 and out.stderr.decode().strip().splitlines()[-1] == f"Error: {words}", out.stderr


def test_cli_generate_stats_show_the_runs_sharing(tiny_engine_dir):
    prompt = "x" * 40
    result = CliRunner().invoke(main, ["generate", str(tiny_engine_dir), "--prompt", prompt, "--max-tokens", "3",
                                       "--n", "3", "--temperature", "1", "--stats"])
    assert result.exit_code == 0, result.output
    stats = dict(line.split(": ", 1) for line in result.stderr.splitlines() if ": " in line)
    assert stats["execution_plan"].startswith("torch: fused (")  # examples/tiny.yaml: float32 weights on the CPU
    assert int(stats["kv_blocks_used_peak"]) >= 3 and int(stats["kv_blocks_saved_by_sharing_peak"]) >= 2 * 2


def test_cli_generate_refuses_max_tokens_past_max_seq_len(tiny_engine_dir):
    result = CliRunner().invoke(main, ["generate", str(tiny_engine_dir), "--prompt", "hi", "--max-tokens", "5000"])
    assert result.exit_code == 1
    assert "--max-tokens:" in result.output and "max_seq_len (512)" in result.output


@pytest.mark.parametrize("device, named", [("gpu", "'gpu' is not"), ("cuda", "no CUDA GPU is visible")])
def test_cli_unavailable_device_is_one_line(tiny_engine_dir, device, named):
    import torch

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for command in (["generate", str(tiny_engine_dir), "--prompt", "hi"],
                    ["serve", str(tiny_engine_dir), "--port", "0"]):
        result = CliRunner().invoke(main, command + ["--device", device])
        assert result.exit_code == 1
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and named in lines[0] and "available here: cpu" in lines[0], result.output


def test_generate_refusing_one_prompt_queues_none_of_them(tiny_engine_dir):
    llm = LLM(tiny_engine_dir, device="cpu")
    with pytest.raises(ValueError, match=r"max_seq_len \(512\)"):
        llm.generate(["hello", [5] * 600], SamplingParams(max_tokens=8, temperature=0.0))
    assert not llm.engine.has_unfinished()
    assert llm.stats()["num_waiting"] == 0 and llm.stats()["kv_blocks_used"] == 0
    assert [o.prompt for o in llm.generate(["world"], SamplingParams(max_tokens=8, temperature=0.0))] == ["world"]
    assert llm.stats()["prefix_cache_queries_tokens"] == len("world")  # "hello" never ran


def test_failed_step_returns_every_block(tiny_engine_dir) -> None:
    """An engine step that raises must not leave the call's requests queued or holding blocks."""
    llm = LLM(tiny_engine_dir)
    backend = llm.engine.runner
    real_step = backend.step
    calls = {"n": 0}

    def failing_step(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real_step(batch)

    backend.step = failing_step
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(["hello there", "general kenobi"], SamplingParams(max_tokens=8, temperature=0.0))
    backend.step = real_step
    assert not llm.engine.has_unfinished()
    assert llm.stats()["kv_blocks_used"] == 0
    # and the LLM keeps working
    out = llm.generate(["hello there"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("prompt, named", [([1, 2, 10**9], "token id 1000000000 is outside the vocabulary"),
                                           ([-1], "token id -1 is outside"), ([1, "x"], "list of ints"),
                                           ([True], "list of ints")])
def test_token_id_prompts_outside_the_vocabulary_are_refused(llm, prompt, named):
    from trtpaged.errors import RequestError

    with pytest.raises(RequestError, match=named) as e:
        llm.generate([prompt], SamplingParams(max_tokens=2))
    assert e.value.field == "prompt"
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_pool_smaller_than_max_seq_len_is_said_at_start_and_a_lone_sequence_ends_where_it_is_full(
        tiny_engine_dir, caplog):
    """vLLM refuses to start with such a pool; here it is logged, and a request that outgrows it ends with "length"
    at the pool's size (the same alone as after another request)."""
    with caplog.at_level("WARNING", logger="trtpaged.runtime"):
        small = LLM(tiny_engine_dir, device="cpu", num_kv_blocks=4, warmup=False)
    assert any("the KV pool holds 64 tokens (4 blocks), fewer than max_seq_len 512" in r.message
               for r in caplog.records)
    greedy = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    first, second = (small.generate([[5, 6, 7]], greedy)[0].outputs[0] for _ in range(2))
    # 64 slots: the 3 prompt tokens and 61 generated ones computed, and the token sampled from the last (never computed)
    assert len(first.token_ids) == 64 - 3 + 1 and first.finish_reason == "length"
    assert (second.token_ids, second.finish_reason) == (first.token_ids, "length")


def test_generate_from_several_threads_at_once_answers_each_as_alone(llm):
    """LLM.generate steps the engine until all its requests finish: two threads at once stepped one engine together
    (KeyError / IndexError). Calls now run one at a time; every thread's answers are the single-threaded ones."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(5)]
    truth = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    results: list = []

    def work() -> None:
        try:
            for _ in range(3):
                results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        except Exception as exc:  # noqa: BLE001  (collected: the assertion below shows it)
            results.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [truth] * 12
    assert llm.stats()["kv_blocks_used"] == 0

    class CallsBack:  # a progress bar (vLLM's use_tqdm may be a tqdm-like class) that generates from its update
        def __init__(self, *args, **kwargs) -> None:
            pass

        def update(self, n: int) -> None:
            llm.generate(prompts[:1], params, use_tqdm=False)

        def close(self) -> None:
            pass

    with pytest.raises(RuntimeError, match="called from inside a running call"):  # was: KeyError, a lost output
        llm.generate(prompts, params, use_tqdm=CallsBack)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == truth
    assert llm.stats()["kv_blocks_used"] == 0


def test_stats_from_another_thread_waits_for_the_running_call(llm):
    """stats() read the engine while another thread's generate stepped it (a step half applied could show). It now
    waits for the running call; the call's own thread (its progress bar) still reads between steps."""
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (2, 8)]
    seen: dict = {}

    def read_from_another_thread() -> None:
        seen["other"] = llm.stats()

    class ReadsStats:
        def __init__(self, *args, **kwargs) -> None:
            self.other = threading.Thread(target=read_from_another_thread)

        def update(self, n: int) -> None:
            if "own" in seen:
                return
            seen["own"] = llm.stats()  # the owner thread: no deadlock
            self.other.start()
            self.other.join(0.5)
            seen["other_done_during_call"] = "other" in seen

        def close(self) -> None:
            pass

    bar = {}

    def make_bar(*args, **kwargs):
        bar["it"] = ReadsStats()
        return bar["it"]

    llm.generate([[5, 6, 7], [8, 9, 10]], params, use_tqdm=make_bar)
    bar["it"].other.join(30)
    assert seen["own"]["kv_blocks_used"] > 0  # read inside the call: the other request still holds its blocks
    assert seen["other_done_during_call"] is False
    assert seen["other"]["kv_blocks_used"] == 0  # read once the call had finished


def test_a_closed_llm_refuses_calls(tiny_engine_dir):
    closed = LLM(tiny_engine_dir, device="cpu")
    closed.close()
    closed.close()  # idempotent
    with pytest.raises(RuntimeError, match="LLM.generate: this LLM is closed"):
        closed.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
