"""One `PackSet.pack` and one `UnpackSet.unpack` of the tp=1 Kimi-Linear request under ncu.

    ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section WarpStateStats --section LaunchStats \
        --section SchedulerStats --section SourceCounters python -m benchmarks.ncu_probe

Warms up (JIT compiles, then direct launches, as the connector makes them), then profiles one
call of each between `cudaProfilerStart` and `cudaProfilerStop`: the three pack launches and
the three unpack launches of `bench_kernels.py`'s request. What it showed on the H200
(`benchmarks/results/nvidia-h200-2f11b0a-ncu.txt`): both kernels issue-bound, not memory-bound.
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    if not torch.cuda.is_available():
        print("ncu_probe needs CUDA", file=sys.stderr)
        return 2
    from anchorkv.kernels import launch
    from benchmarks.bench_kernels import request

    req = request(1)
    for _ in range(3):
        req.pack_set.pack(req.slot_ids)
        req.unpack_set.unpack(req.packed_batch, req.slot_ids)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    req.pack_set.pack(req.slot_ids)
    req.unpack_set.unpack(req.packed_batch, req.slot_ids)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("launches", launch.counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
