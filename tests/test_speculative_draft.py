"""Speculative decoding with a draft engine, against independent truths: HF generate and the same engine
without speculation (greedy), the target's exact distribution (chi-square, with a draft whose q differs from
p), exact block accounting of the target's and the draft's pools, and clear errors for bad drafts."""

from __future__ import annotations

import collections
import copy
import random

import pytest
import torch

from conftest import EXAMPLES, build_from_dict
from runtime_helpers import (RandomLogitsEngine, hf_greedy, run_staggered, runtime_config, serve_one_completion,
                             step_engine, tiny_hf)  # fmt: skip
from test_speculative import EOS, assert_accounting, assert_target_distribution, greedy_chain, run_storm
from trtpaged.runtime.draft import DraftProposer
from trtpaged.runtime.llm_engine import LLMEngine
from trtpaged.runtime.sampling_params import SamplingParams
from trtpaged.runtime.speculative import SpeculativeConfig

ALWAYS = dict(disable_by_batch_size=None, min_acceptance_rate=0.0, verify_row_cost=0.0, draft_token_cost=0.0)


def draft_spec(k: int, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model="(in-process)", num_speculative_tokens=k, **{**ALWAYS, **kw})


@pytest.fixture(scope="module")
def hf():
    return tiny_hf()


@pytest.fixture(scope="module")
def draft_hf(hf):
    """The target with noise on its LM head: a draft whose q is close to, but not, the target's p."""
    model = copy.deepcopy(hf)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        head = model.model.lm_head.weight
        head += 0.5 * head.std() * torch.randn(head.shape, generator=g)
    return model


def draft_proposer(draft_hf, num_kv_blocks: int = 64, block_size: int = 8) -> DraftProposer:
    config = runtime_config(num_kv_blocks=num_kv_blocks, block_size=block_size)
    return DraftProposer(step_engine(draft_hf, config), num_kv_blocks, block_size, 256, 512, 320)


def make(hf, draft_hf=None, spec=None, draft_blocks: int = 64, **kw) -> LLMEngine:
    config = runtime_config(speculative=spec, **kw)
    draft = draft_proposer(draft_hf, draft_blocks) if draft_hf is not None else None
    return LLMEngine(step_engine(hf, config), config, hf.tokenizer, [EOS], draft=draft)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    rand = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 54)]
    passage = torch.randint(0, 256, (23,), generator=g).tolist()
    return rand + [passage * 2, [5, 6] * 12]


def assert_draft_accounting(engine: LLMEngine) -> None:
    """The draft's pool: every block's ref_cnt is the number of draft tables holding it, a mirror holds exactly
    the blocks of its computed tokens, and only live sequences have one."""
    draft = engine.scheduler.draft
    assert draft is not None
    kv, bs = draft.kv, draft.kv.block_size
    refs = collections.Counter(b.block_id for table in kv.tables.values() for b in table)
    for block in kv.pool.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0), block
    live = {s.seq_id for s in engine.scheduler.live_seqs()}
    assert set(draft.mirrors) <= live
    assert set(kv.tables) <= set(draft.mirrors)
    for seq_id, mirror in draft.mirrors.items():
        assert len(kv.tables.get(seq_id, [])) == -(-mirror.num_computed_tokens // bs), mirror


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identical_to_hf_and_to_no_speculation(hf, draft_hf, prompts, k):
    params = SamplingParams(max_tokens=32, temperature=0.0, logprobs=0)
    reference = [hf_greedy(hf, p, 32, EOS) for p in prompts]
    engine = make(hf, draft_hf, draft_spec(k), block_size=8)
    got = run_staggered(engine, [(p, params) for p in prompts], every=2)
    plain = make(hf)
    want = run_staggered(plain, [(p, params) for p in prompts], every=2)
    assert [o.outputs[0].token_ids for o in got] == reference == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got, want):
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    if k > 1:
        assert stats["num_steps"] < plain.stats()["num_steps"]
    assert stats["spec_decode_draft_num_steps"] > 0
    assert engine.kv.pool.num_free == engine.config.num_kv_blocks
    assert stats["spec_decode_draft_kv_blocks_free"] == stats["spec_decode_draft_kv_blocks_total"] == 64


def test_a_stop_string_just_before_an_end_token_in_one_accepted_run_ends_the_output(hf, prompts):
    """A draft equal to the target (every draft token accepted), so a stop string and the stop token id right
    after it are verified in one run: the stop string ends the output, cut and named as without speculation
    (was: the stop token id ended it, the stop string's text kept and stop_reason the token id)."""
    g = torch.Generator().manual_seed(5)
    many = prompts + [torch.randint(0, 256, (8,), generator=g).tolist() for _ in range(24)]
    plain = make(hf)
    outs = [o.outputs[0] for o in run_staggered(plain, [(p, SamplingParams(max_tokens=40, temperature=0.0))
                                                        for p in many])]  # fmt: skip
    cases = []
    for p, out in zip(many, outs):
        for k in range(2, len(out.token_ids)):  # the text token k - 1 adds is the stop string, token k the stop id
            head, upto = (hf.tokenizer.decode(out.token_ids[:j]) for j in (k - 1, k))
            added = upto[len(head):] if upto.startswith(head) else ""
            fresh = out.token_ids[k] not in out.token_ids[:k] and added not in head
            if added and "\ufffd" not in upto and fresh:  # text the detokenizer shows as it goes
                cases.append((p, SamplingParams(max_tokens=40, temperature=0.0, stop=(added,), logprobs=0,
                                                stop_token_ids=(out.token_ids[k],))))  # fmt: skip
                break
    assert len(cases) >= 3, cases
    want = run_staggered(make(hf), cases)
    engine = make(hf, copy.deepcopy(hf), draft_spec(8), block_size=8)
    got = run_staggered(engine, cases)
    for a, b in zip(got, want):
        x, y = a.outputs[0], b.outputs[0]
        assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (y.token_ids, y.text, y.finish_reason,
                                                                         y.stop_reason)  # fmt: skip
        assert isinstance(y.stop_reason, str) and len(x.logprobs) == len(x.token_ids)
        assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-3)
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert engine.kv.pool.num_free == engine.config.num_kv_blocks
    assert_draft_accounting(engine)


def test_the_draft_catches_up_on_the_bonus_token(hf, draft_hf, prompts):
    """After every verification the draft's cache holds the sequence's tokens up to the accepted drafts it
    computed (never a rejected one); the next proposal computes the rest (the bonus token) first."""
    engine = make(hf, draft_hf, draft_spec(3), block_size=8)
    request = engine.add_request(prompts[3], SamplingParams(max_tokens=30, temperature=0.0))
    draft = engine.scheduler.draft
    while engine.has_unfinished():
        engine.step()
        assert_draft_accounting(engine)
        group = engine.groups.get(request)
        if group is not None and group.seqs and group.seqs[0].seq_id in draft.mirrors:
            seq, mirror = group.seqs[0], draft.mirrors[group.seqs[0].seq_id]
            assert mirror.token_ids == seq.token_ids[: mirror.num_computed_tokens]
            assert mirror.num_computed_tokens <= len(seq.token_ids)
    assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
    assert draft.kv.pool.num_free == draft.kv.pool.num_kv_blocks


def test_sampled_distribution_is_the_targets(hf, draft_hf, prompts):
    """Chi-square of 3-token outputs against the target's exact joint probabilities (HF forward), the draft
    sampling from its own q != p: min(1, p/q) acceptance and the residual norm(max(0, p - q))."""
    prompt = prompts[1]
    engine = make(hf, draft_hf, draft_spec(2), draft_blocks=512, num_kv_blocks=512, max_batch_size=64,
                  max_num_tokens=1024)  # fmt: skip
    assert_target_distribution(engine, hf, prompt, top_k=3, draws=1500, min_accepted=300, min_rejected=100)
    assert engine.scheduler.draft.kv.pool.num_free == 512


def test_seeded_sampled_requests_are_reproducible(hf, draft_hf, prompts):
    """Seeded requests with parallel samples (n=2: each sample speculates with a draft cache of its own after
    the fork) return the same tokens twice; both pools are whole afterwards."""
    cases = [(p, SamplingParams(max_tokens=20, temperature=0.8, top_k=5, seed=s, n=2)) for s, p in enumerate(prompts)]
    engines = [make(hf, draft_hf, draft_spec(3), block_size=8) for _ in range(2)]
    first, second = (run_staggered(e, cases) for e in engines)
    assert [[c.token_ids for c in o.outputs] for o in first] == [[c.token_ids for c in o.outputs] for o in second]
    for engine in engines:
        assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
        assert engine.kv.pool.num_free == engine.config.num_kv_blocks
        assert engine.scheduler.draft.kv.pool.num_free == 64


def test_seeded_sampled_requests_return_the_unspeculated_tokens_whatever_the_batch(hf, prompts):
    """A seeded sampled request returns the tokens it returns without speculation, alone or beside others: its
    draft is the draft's argmax (a deterministic proposal, verified with one draw of its own generator per
    output token). Was: it drew its draft from q and verified by min(1, p/q), consuming its generator by how
    much it speculated, which the batch decides (the batch-size rule, the token budget): another sample alone
    than beside three others."""
    seeded = SamplingParams(max_tokens=20, temperature=0.8, top_k=5, seed=7, ignore_eos=True)
    other = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    # the target drafting for itself: its draft tokens are often right
    spec = draft_spec(3, disable_by_batch_size=4)
    for prompt in prompts[3:]:
        (want,) = run_staggered(make(hf), [(prompt, seeded)])
        engine = make(hf, hf, spec)
        (alone,) = run_staggered(engine, [(prompt, seeded)])
        assert engine.stats()["spec_decode_num_accepted_tokens"] > 0
        beside = run_staggered(make(hf, hf, spec), [(prompt, seeded)] + [(p, other) for p in prompts[:3]], every=0)[0]
        assert alone.outputs[0].token_ids == want.outputs[0].token_ids == beside.outputs[0].token_ids


class _Table(RandomLogitsEngine):
    """A RandomLogitsEngine whose logits table is another one's plus noise (a draft close to the target)."""

    def __init__(self, num_kv_blocks: int, target: RandomLogitsEngine, noise: float) -> None:
        super().__init__(num_kv_blocks, target.table.shape[0])
        self.table = target.table + noise * torch.randn(target.table.shape, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_accept_reject_storm_keeps_both_pools_exact(mode):
    """Greedy and sampled rows, a draft close to the target, block pressure in both pools, preemption and
    prefix-cache hits: both pools' accounting holds after every step, greedy outputs are the model's, and
    both pools are whole at the end."""
    rng = random.Random(2)
    num_kv_blocks, draft_blocks, vocab = 24, 20, 12
    config = runtime_config(num_kv_blocks=num_kv_blocks, block_size=4, max_batch_size=6, max_num_tokens=40,
                            max_seq_len=96, preemption_mode=mode, num_host_blocks=64 if mode == "swap" else 0,
                            speculative=draft_spec(4))  # fmt: skip
    runner = RandomLogitsEngine(num_kv_blocks, vocab)
    draft = DraftProposer(_Table(draft_blocks, runner, 0.7), draft_blocks, 4, 40, 96, vocab)
    engine = LLMEngine(runner, config, None, [], draft=draft)
    ids, done, requests, expected = run_storm(engine, runner.table, rng,
                                              lambda: (assert_accounting(engine), assert_draft_accounting(engine)))
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]  # rejections happened
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits_tokens"] > 0
    for i, request_id in enumerate(ids):
        assert len(done[request_id].outputs[0].token_ids) == requests[i][1].max_tokens
        if i in expected:
            assert done[request_id].outputs[0].token_ids == expected[i], i
    assert engine.kv.pool.num_free == num_kv_blocks
    assert draft.kv.pool.num_free == draft_blocks and not draft.mirrors


def test_a_full_draft_pool_only_stops_speculation():
    """A draft pool too small for every sequence: the ones that do not fit decode without a draft; outputs
    are unchanged and nothing leaks."""
    config = runtime_config(num_kv_blocks=64, block_size=4, max_batch_size=8, speculative=draft_spec(3))
    runner = RandomLogitsEngine(64, 10)
    draft = DraftProposer(_Table(6, runner, 0.3), 6, 4, 256, 512, 10)
    engine = LLMEngine(runner, config, None, [], draft=draft)
    prompts = [[i, i + 1, i + 2, i + 3, i] * 2 for i in range(4)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = run_staggered(engine, [(p, params) for p in prompts], every=0)
    assert [o.outputs[0].token_ids for o in outs] == [greedy_chain(runner.table, p, 12) for p in prompts]
    assert engine.stats()["spec_decode_num_drafts"] > 0
    assert draft.kv.pool.num_free == 6 and engine.kv.pool.num_free == 64


@pytest.mark.parametrize("bad, field", [
    (dict(method="draft_model"), "speculative_config.model"), (dict(model="x"), "speculative_config.model"),
    (dict(method="draft_model", model=""), "speculative_config.model"), (dict(method="eagle"), "method"),
])  # fmt: skip
def test_config_errors_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.parse(bad)


# ---- engine dirs ---------------------------------------------------------------------------------------
def _tiny(**changes) -> dict:
    import yaml

    data = yaml.safe_load((EXAMPLES / "tiny.yaml").read_text())
    data.pop("output", None)
    data["model"]["tiny"].update(changes.pop("tiny", {}))
    data.update(changes)
    return data


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-engines")
    return {"same_vocab": build_from_dict(_tiny(tiny={"seed": 1, "num_hidden_layers": 1}),
                                          root / "tiny-draft"),
            "other_vocab": build_from_dict(_tiny(tiny={"vocab_size": 300}), root / "tiny-v300"),
            "short": build_from_dict(_tiny(max_seq_len=256), root / "tiny-short"),
            "one_seq": build_from_dict(_tiny(tiny={"seed": 1, "num_hidden_layers": 1}, max_batch_size=1,
                                             max_num_tokens=64), root / "tiny-one-seq")}  # fmt: skip


def test_llm_with_a_draft_engine_dir(tiny_engine_dir, draft_dirs):
    """A second, smaller random engine with the same tokenizer drafts for the tiny engine: greedy text as
    without speculation; stats show the draft's pool; bad draft dirs are clear errors naming the field."""
    from trtpaged import LLM

    prompts = ["abcabcabcabcabc", "the cat sat on the mat, the cat"]
    params = SamplingParams(max_tokens=20, temperature=0.0)
    want = LLM(tiny_engine_dir, device="cpu").generate(prompts, params)
    config = {"method": "draft_model", "model": str(draft_dirs["same_vocab"]), "num_speculative_tokens": 3,
              "min_acceptance_rate": 0, "draft_token_cost": 0}  # fmt: skip
    llm = LLM(tiny_engine_dir, device="cpu", speculative_config=config)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = llm.stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_draft_num_steps"] > 0
    assert stats["spec_decode_draft_kv_blocks_free"] == stats["spec_decode_draft_kv_blocks_total"]
    for key, message in (("other_vocab", "vocab_size is 300, the target's 320"),
                         ("short", r"max_seq_len \(256\) is below the target's \(512\)")):  # fmt: skip
        with pytest.raises(ValueError, match=f"speculative_config.model: .*{message}"):
            LLM(tiny_engine_dir, device="cpu", speculative_config={**config, "model": str(draft_dirs[key])})
    with pytest.raises(ValueError, match="speculative_config.model: .* is not a usable engine dir"):
        LLM(tiny_engine_dir, device="cpu", speculative_config={**config, "model": str(draft_dirs["short"]) + "-none"})


def test_a_draft_steps_no_more_sequences_than_its_engine_takes(tiny_engine_dir, draft_dirs, monkeypatch):
    """A draft built for one sequence at a time got packed steps of several (a TensorRT plan refuses a batch
    outside its profile); now the others do not speculate that step, and greedy outputs stay the same. A bad
    draft is refused before the target's weights load."""
    from trtpaged import LLM
    import trtpaged.runtime.llm as llm_module

    prompts = ["abcabcabcabcabc", "the cat sat on the mat, the cat", "xyzxyzxyz"]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    want = LLM(tiny_engine_dir, device="cpu", warmup=False).generate(prompts, params)
    config = {"method": "draft_model", "model": str(draft_dirs["one_seq"]), "num_speculative_tokens": 3,
              "min_acceptance_rate": 0, "draft_token_cost": 0}  # fmt: skip
    llm = LLM(tiny_engine_dir, device="cpu", warmup=False, speculative_config=config)
    draft_runner = llm.engine.scheduler.draft.runner
    seqs_per_step = []
    real_step = draft_runner.step
    monkeypatch.setattr(draft_runner, "step", lambda batch: seqs_per_step.append(len(batch.context_lens)) or
                        real_step(batch))  # fmt: skip
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert seqs_per_step and max(seqs_per_step) == 1 and llm.stats()["spec_decode_num_drafts"] > 0
    loads = []
    real_load = llm_module.load_runner
    monkeypatch.setattr(llm_module, "load_runner", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    with pytest.raises(ValueError, match="speculative_config.model: .*vocab_size is 300"):
        LLM(tiny_engine_dir, device="cpu", speculative_config={**config, "model": str(draft_dirs["other_vocab"])})
    assert loads == []


def test_server_metrics_carry_the_method_and_the_draft_pool(tiny_engine_dir, draft_dirs):
    """A real loopback server with a draft engine: the official openai client gets the text `LLM` gets without
    speculation; /metrics labels the spec_decode counters method="draft_model" and shows the draft's pool
    (the size `LLM.stats()` reports, every block free again once the request is done) and its steps."""
    from trtpaged import LLM
    from trtpaged.runtime.speculative import SpeculativeConfig

    prompt = "abcabcabcabcabc"
    want = LLM(tiny_engine_dir, device="cpu").generate(prompt, SamplingParams(max_tokens=16, temperature=0.0))
    config = {"method": "draft_model", "model": str(draft_dirs["same_vocab"]), "num_speculative_tokens": 3,
              "draft_token_cost": 0}  # fmt: skip
    pool = LLM(tiny_engine_dir, device="cpu", speculative_config=config).stats()["spec_decode_draft_kv_blocks_total"]
    text, values = serve_one_completion(tiny_engine_dir, prompt, 16, SpeculativeConfig.parse(config))
    assert text == want[0].outputs[0].text
    assert values['trtpaged:spec_decode_num_drafts_total{method="draft_model"}'] > 0
    assert not any('method="ngram"' in k for k in values)
    assert values["trtpaged:spec_decode_draft_kv_cache_blocks"] == pool > 0
    assert values["trtpaged:spec_decode_draft_kv_cache_blocks_free"] == pool
    assert values["trtpaged:spec_decode_draft_steps_total"] > 0
    assert values["trtpaged:spec_decode_draft_tokens_computed_total"] >= len(prompt)  # the prompt (a byte each), once


def test_a_draft_as_costly_as_the_target_is_never_run(tiny_engine_dir, draft_dirs):
    """The default draft_token_cost is the ratio of the engines' weight bytes: the target drafting for itself
    costs a whole step per draft token, so no draft length pays even at full acceptance: the draft never
    runs (no probes either) and the text is the same. A smaller draft gets its smaller ratio."""
    from trtpaged import LLM

    prompts = ["abcabcabcabcabc", "the cat sat on the mat, the cat"]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    want = LLM(tiny_engine_dir, device="cpu").generate(prompts, params)
    config = {"method": "draft_model", "model": str(tiny_engine_dir), "num_speculative_tokens": 4}
    llm = LLM(tiny_engine_dir, device="cpu", speculative_config=config)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = llm.stats()
    assert stats["spec_decode_draft_token_cost"] == 1.0
    assert stats["spec_decode_num_drafts"] == 0 and stats["spec_decode_draft_num_steps"] == 0

    def weights(path):
        return (path / "weights.safetensors").stat().st_size

    small = draft_dirs["same_vocab"]  # one layer of the target's two
    llm = LLM(tiny_engine_dir, device="cpu", speculative_config={**config, "model": str(small)})
    assert llm.stats()["spec_decode_draft_token_cost"] == pytest.approx(weights(small) / weights(tiny_engine_dir))
    assert 0 < llm.stats()["spec_decode_draft_token_cost"] < 1


def test_draft_token_cost_in_the_rule():
    """k draft tokens add k draft steps to the cost: a draft that costs a whole step never pays, a cheap one
    with a high acceptance verifies the most it may, and a dearer draft never verifies more tokens."""
    from trtpaged.runtime.speculative import AcceptanceTracker, best_draft_length

    assert best_draft_length(1.0, 4, 0.3, 1, draft_cost=1.0) == 0
    assert best_draft_length(0.95, 4, 0.3, 1, draft_cost=0.2) == 4
    for rate in (0.5, 0.8, 0.95):
        lengths = [best_draft_length(rate, 8, 0.3, 1, draft_cost=c / 10) for c in range(11)]
        assert lengths == sorted(lengths, reverse=True)
    costly, cheap = AcceptanceTracker(0.3, draft_cost=1.0), AcceptanceTracker(0.3, draft_cost=0.2)
    assert [costly.tokens(1, 4, 1, free_shadow=False) for _ in range(600)] == [0] * 600  # no probes either
    assert cheap.tokens(1, 4, 1, free_shadow=False) == 4


@pytest.mark.parametrize("value", [-0.1, 101, float("nan"), float("inf"), True, "1"])
def test_draft_token_cost_is_checked(value):
    with pytest.raises(ValueError, match=r"speculative_config.draft_token_cost: must be a number in \[0, 100.0\]"):
        SpeculativeConfig(method="draft_model", model="d", draft_token_cost=value)
    with pytest.raises(ValueError, match="speculative_config.draft_token_cost: only for method draft_model"):
        SpeculativeConfig(method="ngram", draft_token_cost=0.5)


def test_inspect_checks_a_draft(tiny_engine_dir, draft_dirs):
    from click.testing import CliRunner

    from trtpaged.cli import main

    ok = CliRunner().invoke(main, ["inspect", str(tiny_engine_dir), "--draft", str(draft_dirs["same_vocab"])])
    assert ok.exit_code == 0, ok.output
    assert f"speculative draft {draft_dirs['same_vocab']}: compatible" in ok.output
    bad = CliRunner().invoke(main, ["inspect", str(tiny_engine_dir), "--draft", str(draft_dirs["other_vocab"])])
    # named as the option typed (was: "speculative_config.model: ...", a field inspect has no option of)
    assert bad.exit_code == 1 and "Error: --draft: the draft engine's vocab_size is 300" in bad.output


# ---- SmolLM2 (slow) ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_greedy_identical_with_a_draft_engine(request):
    """The int4 SmolLM2 engine drafting for itself through the engine-dir path: greedy outputs as without
    speculation, and nearly every draft token accepted (the same model; only the step shapes differ)."""
    import os

    from trtpaged import LLM

    engine_dir = os.environ.get("TRTPAGED_SMOLLM2_INT4_DIR") or str(request.getfixturevalue("smollm2_int4_engine_dir"))
    plain = LLM(engine_dir, device="cpu", num_kv_blocks=64, warmup=False)
    texts = [plain.chat_prompt([{"role": "user", "content": "Name three colours."}]), "The capital of France is"]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    want = plain.generate(texts, params)
    config = {"method": "draft_model", "model": engine_dir, "num_speculative_tokens": 4, "draft_token_cost": 0}
    spec = LLM(engine_dir, device="cpu", num_kv_blocks=64, warmup=False, speculative_config=config)
    got = spec.generate(texts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = spec.stats()
    assert stats["spec_decode_acceptance_rate"] > 0.9 and stats["num_steps"] < plain.stats()["num_steps"]


@pytest.mark.parametrize("held", [-1, "106000000", 1.5, True, float("nan")])
def test_a_lying_weight_bytes_figure_is_refused_by_name(tiny_engine_dir, held):
    """The default draft_token_cost reads the manifest's quantization.weight_bytes, an untrusted figure: a
    negative, fractional, boolean or text value is an EngineDirError naming the field, not a ratio."""
    import dataclasses

    from trtpaged.engine_files import held_weight_bytes
    from trtpaged.manifest import EngineDirError, read_manifest

    manifest = dataclasses.replace(read_manifest(tiny_engine_dir), quantization={"weight_bytes": held})
    with pytest.raises(EngineDirError, match="quantization.weight_bytes: expected a whole number of bytes >= 0"):
        held_weight_bytes(tiny_engine_dir, manifest)
    good = dataclasses.replace(manifest, quantization={"weight_bytes": 12345})
    assert held_weight_bytes(tiny_engine_dir, good) == 12345


def test_a_draft_vocabulary_that_differs_is_named_by_its_first_differing_token():
    """The refusal of a draft whose tokenizer maps tokens to other ids says which token (was: no example)."""
    from trtpaged.runtime.draft import _first_difference

    target = {"a": 0, "b": 1, "c": 2}
    assert _first_difference({"b": 0, "a": 1, "c": 2}, target) == "'a' is id 0 in the target's, id 1 in the draft's"
    assert _first_difference({"a": 0, "c": 2}, target) == "'b' is id 1 in the target's, absent in the draft's"
    assert _first_difference({**target, "d": 3}, target) == "'d' (id 3) is in the draft's only"
