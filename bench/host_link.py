"""The host link as `activation_offload_layers` uses it: pinned-memory copies on a side stream, alone and while the
GPU runs bf16 matmuls, and how much the copies slow those matmuls.

    python3 bench/host_link.py [--gib 1] [--repeats 5]

Prints one table: GB/s device-to-host and host-to-device alone, the same during a matmul loop, and the matmul
loop's time alone and with the copies beside it. Needs a CUDA GPU."""

from __future__ import annotations

import argparse
import statistics

import torch


def timed(work, repeats: int) -> float:
    """Median seconds of `work()` (which queues GPU work), synchronised around each call."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        work()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="bytes per copy, in GiB")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30)
    device_buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host_buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def matmuls() -> None:
        for _ in range(40):
            torch.mm(a, b)

    def copy(direction: str) -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            if direction == "to host":
                host_buffer.copy_(device_buffer, non_blocking=True)
            else:
                device_buffer.copy_(host_buffer, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    def copy_beside_matmuls(direction: str) -> None:
        copy_done = torch.cuda.Event(enable_timing=True)
        copy_start = torch.cuda.Event(enable_timing=True)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            copy_start.record()
            (
                host_buffer.copy_(device_buffer, non_blocking=True)
                if direction == "to host"
                else device_buffer.copy_(host_buffer, non_blocking=True)
            )
            copy_done.record()
        matmuls()
        torch.cuda.current_stream().wait_stream(side)
        copy_seconds.append((copy_start, copy_done))

    matmuls()
    flops = 40 * 2 * 8192**3
    alone = timed(matmuls, args.repeats)
    print(f"card: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.gib:g} GiB per copy")
    print("| direction | GB/s alone | GB/s beside matmuls | matmul TFLOP/s alone | with the copy |")
    print("|---|---|---|---|---|")
    for direction in ("to host", "to device"):
        copy(direction)
        seconds = timed(lambda d=direction: copy(d), args.repeats)
        copy_seconds: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        beside = timed(lambda d=direction: copy_beside_matmuls(d), args.repeats)
        concurrent_copy = statistics.median(start.elapsed_time(done) / 1e3 for start, done in copy_seconds)
        print(
            f"| {direction} | {nbytes / seconds / 1e9:.1f} | {nbytes / concurrent_copy / 1e9:.1f} "
            f"| {flops / alone / 1e12:.0f} | {flops / beside / 1e12:.0f} |"
        )


if __name__ == "__main__":
    main()
