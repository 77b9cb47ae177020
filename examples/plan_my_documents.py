"""What distca would do with your documents: plans and simulated step times, no GPU, no process group.

    python examples/plan_my_documents.py                       # a small built-in list
    python examples/plan_my_documents.py --doclens lengths.csv --ranks 16 --tokens-per-rank 131072

``--doclens``: a file of document lengths in tokens, in any format ``python -m distca.sim
--doclens`` reads (one length per line, ``length,count`` lines, or JSON). Part 1 packs them in
file order into one step of ``ranks x tokens_per_rank`` tokens and plans its core attention with
a few policies (``distca.plan``). Part 2 asks the simulator what a Llama-3-8B step on H200s
would take with documents sampled from the same lengths (``distca.sim.simulate_config``, the
function behind ``python -m distca.sim``).
"""

import argparse

import numpy as np

import distca
from distca.sim import Options, Workload, load_arch, load_hardware, load_workload, simulate_config

# Lengths of a skewed batch: a few long documents among many short ones (tokens).
BUILT_IN = [9000, 300, 120, 2500, 60, 800, 16000, 450, 3000, 200, 75, 1200, 5000, 640, 90, 2200, 350, 7000, 150, 900]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doclens", metavar="FILE", help="document lengths (default: a built-in list of 20)")
    ap.add_argument("--ranks", type=int, default=4, help="CA ranks (GPUs, or TP groups) in one step")
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--gpus", type=int, default=64, help="simulated GPUs (TP 8 per CA rank)")
    args = ap.parse_args()
    if args.doclens:
        workload = load_workload(args.doclens)  # the simulator's reader: its formats and its errors
    else:
        workload = Workload("built-in", np.asarray(BUILT_IN, dtype=np.int64))
    lengths = workload.lengths

    # 1. One step of your documents, planned by each policy: the modelled attention time per rank
    #    (max / mean: imbalance, 1.0 is even) and the bytes one layer moves between all ranks,
    #    for Llama-3-8B's heads (distca.plan's default shape; the CPU cost model).
    layout = distca.Layout.from_doclens(lengths, ranks=args.ranks, tokens_per_rank=args.tokens_per_rank)
    print(f"{len(lengths)} documents, {int(lengths.sum()):,} tokens; one step: {layout.num_docs} documents "
          f"on {args.ranks} ranks x {args.tokens_per_rank:,} tokens")  # fmt: skip
    print(f"{'policy':<11} {'imbalance':>9} {'tasks':>6} {'MiB fwd+bwd / layer':>20}")
    for policy in ("colocated", "per_doc_cp", "greedy", "distca"):
        p = distca.plan(layout, policy, min_shard=64)
        mib = (p.traffic.total_bytes + p.traffic.total_bwd_bytes) / 2**20
        print(f"{policy:<11} {p.imbalance:9.3f} {p.num_tasks:6d} {mib:20.2f}")

    # 2. The simulator on the same lengths (batches sampled from them, 2 seeds):
    #    Llama-3-8B on H200s, 128K tokens per CA rank.
    opts = Options(policies=("colocated", "wlb_ideal", "distca"), seeds=2, upsample=1)
    rows = simulate_config(load_arch("llama3-8b"), workload, args.gpus, 131072, opts, load_hardware("h200"))
    print(f"\nsimulated step, llama3-8b, {args.gpus} H200s, 128K tokens per CA rank ({opts.seeds} batches):")
    for r in rows:
        print(f"  {r['policy']:<10} ping-pong {'on ' if r['pingpong'] else 'off'} {r['step_s']:7.3f} s/step  "
              f"imbalance {r['imbalance']:.3f}")  # fmt: skip
    print("same with every option: python -m distca.sim --doclens FILE --model llama3-8b --gpus 64 --context 131072")


if __name__ == "__main__":
    main()
