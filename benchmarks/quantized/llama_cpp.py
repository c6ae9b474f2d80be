"""llama.cpp as the baseline, through llama-cpp-python when it is importable.

It is not a dependency of duet. Its default build crashed in its AMX path on Xeons (issue 22);
build it with AMX off and without -march=native (about 5 minutes on 2 cores):

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AMX=OFF -DGGML_AVX512=ON" \
        .venv/bin/pip install --no-cache-dir llama-cpp-python
"""

from __future__ import annotations

import time
from typing import Any


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCppRunner:
    """One GGUF loaded in llama.cpp: greedy decode of a token prompt, timed."""

    def __init__(self, path: str, threads: int | None) -> None:
        from llama_cpp import Llama

        kwargs: dict[str, Any] = {"model_path": path, "n_ctx": 1024, "verbose": False}
        if threads:
            kwargs["n_threads"] = kwargs["n_threads_batch"] = threads
        self.llm = Llama(**kwargs)

    def decode(self, prompt: list[int], new_tokens: int) -> float:
        """Seconds to prefill `prompt` and generate `new_tokens` greedily (EOS ignored)."""
        start = time.perf_counter()
        count = 0
        for _ in self.llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True):
            count += 1
            if count == new_tokens:
                break
        return time.perf_counter() - start
