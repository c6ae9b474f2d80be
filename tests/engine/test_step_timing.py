"""An engine counts its steps and where their time went (`EngineStats.step_seconds`,
`execute_seconds`; `/metrics` exports them: docs/observability.md): the engine's own host work
per step is the difference."""

from __future__ import annotations

from duet.engine import LLM, SamplingParams


def test_steps_and_their_time_are_counted(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, dtype="float32", load_progress=False)
    stats = llm.engine.stats
    assert (stats.num_steps, stats.step_seconds, stats.execute_seconds) == (0, 0.0, 0.0)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert stats.num_steps == 6  # the prompt's step (its first token), then five decodes
    assert stats.step_seconds > stats.execute_seconds > 0
