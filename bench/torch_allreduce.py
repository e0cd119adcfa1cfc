#!/usr/bin/env python3
"""torch.distributed all_reduce (gloo backend, CPU) between spawned processes on loopback.

Measured the way `nodectl bench allreduce` measures: each timed all-reduce of a float32 buffer
of ones starts after a barrier, and its time is the slowest rank's. Prints one JSON object:
per world size and size in MiB, the median time, algbw and busbw (algbw x 2(p-1)/p), in GB/s.

    python3 bench/torch_allreduce.py --peers 2,4 --sizes-mb 1,16,100 --iters 10 --warmup 3
"""
import argparse
import json
import os
import socket
import statistics
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world, port, sizes, iters, warmup, out):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    report = []
    for mib in sizes:
        n = int(mib * (1 << 20)) // 4
        buf = torch.ones(n)
        times = []
        for i in range(warmup + iters):
            buf.fill_(1.0)
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            assert buf[0].item() == world and buf[-1].item() == world
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times.append(elapsed.item())
        t = statistics.median(times)
        algbw = n * 4 / t / 1e9
        report.append({"mib": mib, "time_ms_median": round(t * 1e3, 3),
                       "algbw_gbps_median": round(algbw, 4),
                       "busbw_gbps_median": round(algbw * 2 * (world - 1) / world, 4)})
    dist.destroy_process_group()
    if rank == 0:
        out.put(report)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", default="2,4")
    parser.add_argument("--sizes-mb", default="1,16,100")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    result = {"bench": "torch_allreduce", "backend": "gloo", "worlds": {}}
    for world in [int(p) for p in args.peers.split(",")]:
        out = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, world, port, sizes, args.iters, args.warmup, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        result["worlds"][str(world)] = out.get(timeout=600)
        for p in procs:
            p.join()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
