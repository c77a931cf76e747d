"""The single-request generator as a batch of one (issue 22): what a consumer's stop counts, what a failing
proposer leaves, what bad token ids raise (found by session 45's breaker on dcd1105)."""

import mlx.core as mx
import pytest

from mlx_dflash2 import speculative as spec
from mlx_dflash2.loading import load_target
from mlx_dflash2.proposers import Proposal, Proposer, ProposerSession
from mlx_dflash2.speculative import GenerationState, SpecStats, speculative_generate_step
from mlx_dflash2.target import cache_length

from scripted import ScriptedProposer
from tiny_models import tiny_mlx_lm_dir

B = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_mlx_lm_dir(tmp_path_factory.mktemp("h45") / "dense", "qwen2")
    target, tok, _ = load_target(str(path), dtype=mx.float32)
    prompt = [int(t) for t in tok.encode("Once upon a time there was a little robot who")]
    ref = [t for t, _, _ in speculative_generate_step(prompt, target, None, block_size=1, max_tokens=40,
                                                      adaptive=False)]
    return target, prompt, ref


def test_stop_at_a_rounds_correction_token_counts_drafts_as_the_old_loop(tiny):
    """Round 1 drafts B - 1 and rejects d_1 (offset 0): it emits one token, the correction. A consumer that
    stops at that token (the 2nd) stopped inside round 1: only the drafts at or before the stop count,
    min(n, i + 1) = 1 (accept_hist [1, 0]), as the solo loop of a1b9f22 counted (dcd1105 counted all 7)."""
    target, prompt, ref = tiny
    prop = ScriptedProposer(len(prompt), ref, [0] + [B - 1] * 10, B, target.vocab_rows)
    st = SpecStats()
    g = speculative_generate_step(prompt, target, prop, block_size=B, max_tokens=40, stats=st, adaptive=False)
    got = [next(g)[0] for _ in range(2)]
    g.close()
    assert got == ref[:2]
    assert (st.rounds, st.accepted) == (1, 0)
    assert st.drafted == 1
    assert st.accept_hist == [1, 0] and st.position_proposed == [1, 0]


class _PlainThenBoom(Proposer):
    name, block_size, tap_ids = "boom", 4, ()

    def start(self, prompt):
        return _BoomSession()


class _BoomSession(ProposerSession):
    rounds = 0

    def propose(self, anchor, n, temperature=0.0, key=None):
        self.rounds += 1
        if self.rounds == 4:
            raise RuntimeError("boom")
        return Proposal.empty()  # plain rounds: with RUN_AHEAD the next step is queued ahead


def test_proposer_failure_after_run_ahead_leaves_a_consistent_state(tiny, monkeypatch):
    """A proposer that raises after plain rounds (RUN_AHEAD, the GPU default): the plain step queued ahead is
    dropped, so the state's cache holds exactly ``state.tokens`` (dcd1105: one position more)."""
    monkeypatch.setattr(spec, "RUN_AHEAD", "always")
    target, prompt, ref = tiny
    state = GenerationState()
    got = []
    with pytest.raises(RuntimeError, match="boom"):
        for t, _, _ in speculative_generate_step(prompt, target, _PlainThenBoom(), max_tokens=30, state=state,
                                                 adaptive=False):
            got.append(t)
    assert got == ref[: len(got)]
    assert len(state.tokens) == len(prompt) + len(got) - 1
    assert cache_length(state.cache) == len(state.tokens)


@pytest.mark.parametrize("bad", [[10**9], [-1], "vocab"])
def test_prompt_ids_outside_the_vocabulary_raise_and_lose_nothing(tiny, bad):
    """A token id outside the embedding table (it crashed the process for 10**9, or decoded garbage) is a
    clear ValueError at the request's start; the state passed along still serves the next request."""
    target, prompt, ref = tiny
    ids = prompt[:3] + ([target.vocab_rows] if bad == "vocab" else bad)
    state = GenerationState()
    assert [t for t, _, _ in speculative_generate_step(prompt, target, None, max_tokens=5, state=state)] == ref[:5]
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        next(speculative_generate_step(ids, target, None, max_tokens=5, state=state))
    assert [t for t, _, _ in speculative_generate_step(prompt, target, None, max_tokens=8, state=state)] == ref[:8]
