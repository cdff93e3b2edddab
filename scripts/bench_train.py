"""A small GPT trained with torch.distributed on CPU ranks, fed by a per-rank loader or by msd_dask.

Both pipelines train the same model on the same corpus (the demo), byte
tokenizer, mix (code 0.6 / prose 0.4), ``seq_len`` and micro-batches, one after
the other in one run:

* ``HF streaming``: every rank runs its own Hugging Face ``datasets`` streaming
  loader (``scripts/baselines.py``: ``interleave_datasets`` +
  ``split_dataset_by_node`` + a ``DataLoader`` with ``--loader-workers``
  workers) and packs its own documents sequentially;
* ``msd_dask``: a service on an embedded LocalCluster (``--dask-workers``
  processes) with ``dp = R``, one per variant (``--variants``); every rank
  reads through ``msd_dask.torch.MsdIterableDataset`` in a
  ``DataLoader(batch_size=None, num_workers=0)``.  The variants:
  ``msd`` (the config's cost model, no read-ahead: the setup before the cost
  and prefetch work), ``msd-pf`` (the same, ``prefetch=2``: the adapter's
  thread claims the next batches while the model computes), ``msd-cal``
  (``cost: {linear: α, quadratic: β}`` from the calibration below) and
  ``msd-fit`` (``cost: {fit: true}`` starting from the config's model; every
  rank reports its forward+backward CPU time with ``report_step_time``, the
  planner fits ``α``, ``β`` online), ``msd-out`` (outlier delay,
  ``outliers: {min_length: 0.5}``: pieces longer than half a row are
  held and released a row each, see docs/balance.md) and ``msd-out-fit``
  (outlier delay and the online fit).  Only ``msd-pf`` prefetches, so each
  variant changes one or two things against ``msd``.

Calibration: before training, the same model runs forward+backward in this
process (one thread) on rows of known segment lengths (``seq_len/64`` up to
one ``seq_len`` segment, mixed and half-full rows), timed by the thread's CPU
clock (``time.thread_time``: other jobs on the machine do not inflate it),
fastest of 3; :class:`msd_dask.core.cost.CostFitter` fits ``α·L + β·L²`` to them.

The model: ``--layers`` pre-norm transformer blocks, ``d_model`` 128, 4 heads,
real per-document causal attention: ``scaled_dot_product_attention(is_causal=True)``
on every ``cu_seqlens`` segment separately (cost ∝ Σ Lᵢ², as with varlen flash
attention), padding cut off.  ``R`` ranks are ``torch.multiprocessing.spawn``
processes with a ``gloo`` process group, one thread each; gradients are
flattened and summed with one ``all_reduce`` per step.

Per step every rank times: the data fetch (``next`` on its loader), forward +
backward (wall clock and the thread's CPU time), the gradient ``all_reduce``
and the optimizer step.  Reported per pipeline over the timed steps (after
``--warmup``): steps/s and tokens/s (non padding tokens of all ranks), the
share of step time ranks spent in the all-reduce, the share spent *waiting*
there (all-reduce time minus a no-wait all-reduce of the same tensor,
measured after training with the ranks lined up by a barrier: the rest is
waiting for the slowest rank), the share spent fetching data, the compute
imbalance (max / mean over ranks, averaged over steps) of forward+backward
wall time (``imbal``) and CPU time (``cpu``), the wait those CPU times imply
(``cpu wait``: Σ over steps and ranks of slowest rank's CPU time minus the
rank's own, over Σ of the slowest's: an estimate of the wait without the
time slices other jobs on a shared machine take, which ``wait`` also holds;
it leaves out the optimizer and all-reduce time, so it is a slight
over-estimate of the share), the wait a perfect plan would still leave on
ranks this noisy (``floor``, :func:`noise_floor`: each rank-step keeps the
factor by which its CPU time is off the fitted model below, every rank of a
step gets the same model cost), the imbalance a cost model predicts from the
ranks' segments (``model``) and the best any assignment of each step's
segments to the ranks' rows could reach under it (``bound``,
:func:`msd_dask.core.balance.capacity_bound` over the mean); that model is
``α·L + β·L²`` fitted (``CostFitter``, no prior) after training to every
pipeline's rank-steps: ``(ΣL, ΣL²)`` against the forward+backward CPU time,
i.e. the cost as the ranks ran, which may differ from the calibration's; the fill
(non-padding share of the rows) and the mean attention span (Σ Lᵢ² per token).
The goal line states the issue's target (all-reduce wait <= 2% of step time
with msd_dask) beside each msd_dask variant's measured wait.

    python scripts/bench_train.py --quick          # 2 ranks, 10 timed steps, msd + msd-out-fit
    python scripts/bench_train.py --steps 40       # msd, msd-fit, msd-out, msd-out-fit
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


# ------------------------------------------------------------------ model
class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def attention(self, x: torch.Tensor, cu: list[int]) -> torch.Tensor:
        n, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).view(n, 3, h, d // h).permute(1, 2, 0, 3)  # each [h, n, dh]
        outs = [F.scaled_dot_product_attention(q[:, s:e], k[:, s:e], v[:, s:e], is_causal=True)
                for s, e in zip(cu[:-1], cu[1:], strict=True) if e > s]
        return self.proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(n, d))

    def forward(self, x: torch.Tensor, cu: list[int]) -> torch.Tensor:
        x = x + self.attention(self.ln1(x), cu)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A small GPT over one packed row at a time, attention restricted to each document."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def row_loss(self, ids: torch.Tensor, pos: torch.Tensor, labels: torch.Tensor,
                 cu: list[int]) -> tuple[torch.Tensor, int]:
        """Summed cross-entropy of one row (padding cut off) and its number of labels."""
        used = cu[-1]
        x = self.tok(ids[:used]) + self.pos(pos[:used])
        for b in self.blocks:
            x = b(x, cu)
        logits = self.head(self.ln(x))
        lab = labels[:used]
        return F.cross_entropy(logits, lab, ignore_index=-100, reduction="sum"), int((lab != -100).sum())


# ------------------------------------------------------------------ one rank
def _rank_main(rank: int, a: dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a["port"]))
    dist.init_process_group("gloo", rank=rank, world_size=a["ranks"],
                            timeout=datetime.timedelta(seconds=300))
    torch.manual_seed(0)
    model = TinyGPT(258, a["d_model"], a["layers"], 4, a["seq_len"])
    params = [p for p in model.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    if a["pipeline"] == "hf":
        import baselines

        loader = baselines.hf_loader(baselines.demo_sources(a["root"]), rank, a["ranks"],
                                     a["loader_workers"], a["seq_len"], a["micro_batches"],
                                     seed=a["seed"])
        if a["loader_workers"] > 0 and a["nice_loaders"]:
            loader.worker_init_fn = lambda _: renice(a["nice_loaders"])
        if a["loader_workers"] > 0:
            # a rank started by mp.spawn would spawn its loader workers too; fork them, as a
            # DataLoader does by default on Linux (and the baseline's dataset is a local class)
            loader.multiprocessing_context = "fork"
    else:
        from torch.utils.data import DataLoader

        from msd_dask.torch import MsdIterableDataset

        ds = MsdIterableDataset(a["address"], a["name"], rank, connect_timeout=120,
                                prefetch=a["prefetch"])
        loader = DataLoader(ds, batch_size=None, num_workers=0)
    it = iter(loader)
    recs = []
    total = a["warmup"] + a["steps"]
    dist.barrier()
    t_start = None
    for step in range(total):
        if step == a["warmup"]:
            dist.barrier()
            t_start = time.perf_counter()
        t0 = time.perf_counter()
        b = next(it)
        t1 = time.perf_counter()
        c1 = time.thread_time()
        loss_sum = torch.zeros(())
        n_lab = 0
        segs = []
        for m in range(b["input_ids"].shape[0]):
            cu = [int(c) for c in b["cu_seqlens"][m]]
            segs.extend(e - s for s, e in zip(cu[:-1], cu[1:], strict=True) if e > s)
            loss, n = model.row_loss(b["input_ids"][m], b["position_ids"][m], b["labels"][m], cu)
            loss_sum = loss_sum + loss
            n_lab += n
        (loss_sum / max(n_lab, 1)).backward()
        t2 = time.perf_counter()
        cpu = time.thread_time() - c1   # this rank's own work, without time the OS gave others
        if a.get("report"):
            ds.report_step_time(cpu)    # the planner fits α, β to it (cost: {fit: true})
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        t3 = time.perf_counter()
        flat /= a["ranks"]
        off = 0
        for p in params:
            p.grad.copy_(flat[off:off + p.numel()].view_as(p))
            off += p.numel()
        opt.step()
        opt.zero_grad(set_to_none=False)
        t4 = time.perf_counter()
        if step >= a["warmup"]:
            tokens = sum(int(c[-1]) for c in b["cu_seqlens"])
            recs.append({"data": t1 - t0, "compute": t2 - t1, "cpu": cpu, "allreduce": t3 - t2,
                         "opt": t4 - t3, "step": t4 - t0, "tokens": tokens,
                         "sq": sum(x * x for x in segs), "segs": segs,
                         "loss": float(loss_sum.detach()) / max(n_lab, 1)})
    dist.barrier()
    wall = time.perf_counter() - t_start if t_start is not None else 0.0
    pure = []
    for _ in range(a["pure_reps"]):  # the all-reduce with every rank already there
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(flat)
        pure.append(time.perf_counter() - t)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"recs": recs, "wall": wall, "pure": statistics.median(pure),
                   "row_tokens": a["seq_len"] * a["micro_batches"], "seq_len": a["seq_len"],
                   "micro_batches": a["micro_batches"],
                   "params": sum(p.numel() for p in params)}, f)
    dist.barrier()
    dist.destroy_process_group()
    # the loader's forked workers inherit the end of this process's sentinel that `train`
    # waits on: left to notice this exit (up to 30 s in HF streaming), they would hold it;
    # killed without the DataLoader's SIGCHLD handler, which would raise in this thread
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        child.kill()
    os._exit(0)  # loader workers and the service client need not be drained


def calibrate(a: dict[str, Any], reps: int = 3) -> dict[str, Any]:
    """Fit ``α·L + β·L²`` (seconds) to this model's forward+backward on rows of known segments.

    The same model and code path as a rank (one thread, ``row_loss`` then
    ``backward``) runs on rows made of equal segments (``seq_len/64`` up to one
    segment of ``seq_len``), mixed segments, and half-full rows (they separate
    ``α`` from ``β``); each row is timed ``reps`` times, interleaved, and its
    fastest time is given to :class:`msd_dask.core.cost.CostFitter` (``observe``,
    no prior).  Returns ``alpha``, ``beta``, the rows and times, and the
    largest relative error of the fit over the rows.
    """
    from msd_dask.core.cost import CostFitter

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    n = a["seq_len"]
    model = TinyGPT(258, a["d_model"], a["layers"], 4, n)
    rows = [[max(1, n // k)] * k for k in (64, 16, 8, 4, 2, 1)]
    rows += [[3 * n // 4, n // 4], [n // 2, n // 4, n // 8, n // 8], [n // 2], [n // 16] * 8,
             [n // 4] * 2 + [n // 64] * 32]

    def run(lengths: list[int]) -> float:
        used = sum(lengths)
        ids = torch.randint(0, 256, (used,))
        pos = torch.cat([torch.arange(x) for x in lengths])
        cu = [0]
        for x in lengths:
            cu.append(cu[-1] + x)
        t = time.thread_time()
        loss, count = model.row_loss(ids, pos, ids, cu)
        (loss / count).backward()
        dt = time.thread_time() - t
        model.zero_grad(set_to_none=True)
        return dt

    run(rows[0])                                 # warm-up
    best = [math.inf] * len(rows)
    for _ in range(reps):
        for i, r in enumerate(rows):
            best[i] = min(best[i], run(r))
    torch.set_num_threads(threads)
    fitter = CostFitter(min_observations=1, prior_weight=0.0)
    for r, t in zip(rows, best, strict=True):
        fitter.observe(np.array(r), t)
    fit = fitter.model()
    err = max(abs(fit.total(np.array(r)) - t) / t for r, t in zip(rows, best, strict=True))
    return {"alpha": fit.linear, "beta": fit.quadratic, "rows": rows, "seconds": best,
            "max_rel_error": err}


def renice(n: int) -> None:
    """Lower every thread of this process to nice ``n`` (Linux sets it per thread; new
    threads inherit their creator's)."""
    for tid in os.listdir("/proc/self/task"):
        os.setpriority(os.PRIO_PROCESS, int(tid), n)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train(pipeline: str, a: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the ranks on one pipeline (``hf`` or ``msd``); their records, one dict per rank."""
    import torch.multiprocessing as mp

    a = dict(a, pipeline=pipeline, port=_free_port())
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_rank_main, args=(a, out), nprocs=a["ranks"], join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + a["timeout"]
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"{pipeline}: ranks did not finish within {a['timeout']:.0f}s")
        ranks = []
        for r in range(a["ranks"]):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    return ranks


def residual(ranks: list[dict[str, Any]], per_segment: bool) -> tuple[float, list[float]]:
    """RMS relative error of a least-squares fit of the rank-steps' CPU time to
    ``α·ΣL + β·ΣL²`` (``+ γ·segments`` with ``per_segment``), and the coefficients."""
    rows, y = [], []
    for r in ranks:
        for rec in r["recs"]:
            s = np.asarray(rec["segs"], dtype=np.float64)
            rows.append([s.sum(), (s * s).sum()] + ([float(len(s))] if per_segment else []))
            y.append(rec["cpu"])
    x, t = np.asarray(rows), np.asarray(y)
    coef = np.linalg.lstsq(x, t, rcond=None)[0]
    return float(np.sqrt(np.mean(((x @ coef - t) / t) ** 2))), [float(c) for c in coef]


def noise_floor(model: np.ndarray, cpu: np.ndarray) -> float:
    """The wait share a perfect plan would still leave, from the ranks' CPU-time noise.

    ``model`` and ``cpu`` are ``(steps, ranks)``: each rank-step's cost under a
    cost model and its measured CPU seconds.  Each rank-step keeps its own
    factor ``cpu / model`` (what no function of its segments predicts) while
    every rank of a step is given the same model cost: the ranks then differ
    by those factors alone, and the wait share is computed as ``cpu wait``
    is (Σ slowest minus own over Σ slowest).  A plan cannot go below it on
    ranks this noisy; a rank-step with no model cost is left out.
    """
    model = np.asarray(model, dtype=np.float64)
    cpu = np.asarray(cpu, dtype=np.float64)
    ok = (model > 0).all(axis=1)
    return wait_share(cpu[ok] / model[ok])


def wait_share(times: np.ndarray) -> float:
    """Σ over steps and ranks of the slowest rank's time minus the rank's own, over Σ of the
    slowest's (``times``: ``(steps, ranks)``); 0 when there is no time at all."""
    times = np.asarray(times, dtype=np.float64)
    if times.size == 0:
        return 0.0
    top = times.max(axis=1)
    total = float(top.sum()) * times.shape[1]
    return float((top[:, None] - times).sum()) / total if total > 0 else 0.0


def summarize(ranks: list[dict[str, Any]], cost: tuple[float, float]) -> dict[str, Any]:
    steps = len(ranks[0]["recs"])
    wall = max(r["wall"] for r in ranks)
    tokens = sum(rec["tokens"] for r in ranks for rec in r["recs"])
    step_time = sum(rec["step"] for r in ranks for rec in r["recs"])

    def share(key: str) -> float:
        return sum(rec[key] for r in ranks for rec in r["recs"]) / step_time

    wait = sum(max(0.0, rec["allreduce"] - r["pure"]) for r in ranks for rec in r["recs"])
    from msd_dask.core.balance import capacity_bound

    alpha, beta = cost
    imbalance = []
    cpu_imbalance = []
    model_imbalance = []
    bound = []
    # per step and rank: the cost the model predicts, and the forward+backward CPU seconds
    model = np.array([[alpha * r["recs"][i]["tokens"] + beta * r["recs"][i]["sq"] for r in ranks]
                      for i in range(steps)])
    cpus = np.array([[r["recs"][i]["cpu"] for r in ranks] for i in range(steps)])
    for i in range(steps):
        c = [r["recs"][i]["compute"] for r in ranks]
        imbalance.append(max(c) / (sum(c) / len(c)))
        c = cpus[i].tolist()
        cpu_imbalance.append(max(c) / (sum(c) / len(c)))
        # what the cost model predicts for each rank, and the best any assignment
        # of this step's pieces to the ranks' rows could reach under it
        m = model[i].tolist()
        mean = sum(m) / len(m)
        model_imbalance.append(max(m) / mean if mean > 0 else 1.0)
        lengths = np.array([x for r in ranks for x in r["recs"][i]["segs"]], dtype=np.int64)
        costs = alpha * lengths + beta * lengths.astype(np.float64) ** 2
        bound.append(capacity_bound(lengths, costs, len(ranks), ranks[0]["micro_batches"],
                                    ranks[0]["seq_len"]) / mean if mean > 0 else 1.0)
    return {"steps": steps, "wall": wall, "steps_per_s": steps / wall, "tokens_per_s": tokens / wall,
            "allreduce_share": share("allreduce"), "wait_share": wait / step_time,
            "data_share": share("data"), "compute_share": share("compute"),
            "pure_allreduce_ms": 1e3 * statistics.mean(r["pure"] for r in ranks),
            "compute_imbalance": statistics.mean(imbalance),
            "cpu_imbalance": statistics.mean(cpu_imbalance),
            "cpu_wait_share": wait_share(cpus),
            "noise_floor": noise_floor(model, cpus),
            "model_imbalance": statistics.mean(model_imbalance),
            "bound": statistics.mean(bound),
            "params": ranks[0]["params"],
            "fill": tokens / (len(ranks) * steps * ranks[0]["row_tokens"]),
            "span": sum(rec["sq"] for r in ranks for rec in r["recs"]) / tokens,
            "final_loss": statistics.mean(r["recs"][-1]["loss"] for r in ranks),
            # per step and rank: tokens, Σ L², forward+backward CPU seconds (for offline fits)
            "records": [[[rec["tokens"], rec["sq"], rec["cpu"]] for rec in r["recs"]] for r in ranks]}


#: msd_dask variants: (table name, cost, reader prefetch, report step times)
#: name: (label, cost model, prefetch, report step times, outlier delay)
VARIANTS: dict[str, tuple[str, str, int, bool, bool]] = {
    "msd": ("msd_dask", "config", 0, False, False),
    "msd-pf": ("msd_dask +prefetch 2", "config", 2, False, False),
    "msd-cal": ("msd_dask calibrated cost", "calibrated", 0, False, False),
    "msd-fit": ("msd_dask fit online", "fit", 0, True, False),
    "msd-out": ("msd_dask outlier delay", "config", 0, False, True),
    "msd-out-fit": ("msd_dask outliers+fit", "fit", 0, True, True),
}
GOAL_WAIT = 0.02


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--root", default="data/demo")
    p.add_argument("--ranks", "-R", type=int, default=2)
    p.add_argument("--steps", type=int, default=60, help="timed steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--loader-workers", type=int, default=1, help="baseline DataLoader workers per rank")
    p.add_argument("--dask-workers", type=int, default=2)
    p.add_argument("--nice-loaders", type=int, default=0,
                   help="run the loaders' processes (the baseline's DataLoader workers, "
                        "msd_dask's dask workers) at this nice level, as if they had CPUs "
                        "of their own; a labelled variant, 0 by default")
    p.add_argument("--pure-reps", type=int, default=20)
    p.add_argument("--variants", default=None,
                   help="comma-separated msd_dask variants, from " + ", ".join(VARIANTS)
                        + " (default: msd,msd-fit,msd-out,msd-out-fit; --quick: msd,msd-out-fit; "
                          "--smoke: msd-out-fit)")
    p.add_argument("--timeout", type=float, default=900, help="per pipeline")
    p.add_argument("--quick", action="store_true", help="10 timed steps after 2")
    p.add_argument("--smoke", action="store_true", help="3 timed steps, seq_len 512 (CI)")
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args(argv)
    variants = "msd,msd-fit,msd-out,msd-out-fit"
    if a.quick:
        a.steps, a.warmup = 10, 2
        variants = "msd,msd-out-fit"
    if a.smoke:
        a.steps, a.warmup, a.seq_len, a.pure_reps = 3, 1, 512, 5
        variants = "msd-out-fit"  # the variant whose ranks report costs: the most code
    chosen = [v.strip() for v in (a.variants or variants).split(",") if v.strip()]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown or not chosen:
        p.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    from msd_dask import DataService, load_config

    base = load_config(a.config).to_dict()
    args = {k: v for k, v in vars(a).items() if k not in ("config", "json", "variants")}
    args["seed"] = int(base["seed"])
    t0 = time.perf_counter()
    cal = calibrate(args) if any(VARIANTS[v][1] == "calibrated" for v in chosen) else None
    raw = {"HF streaming (per rank)": train("hf", dict(args, prefetch=0))}
    planner: dict[str, dict[str, Any]] = {}
    for v in chosen:
        label, how, prefetch, report, delay = VARIANTS[v]
        cost_cfg: dict[str, Any] = dict(base["cost"])
        if how == "calibrated" and cal is not None:
            cost_cfg = {"linear": cal["alpha"], "quadratic": cal["beta"]}
        elif how == "fit":
            cost_cfg["fit"] = True                  # starts from the config's model
        cfg = dict(base, name="benchtrain", parallel={"dp": a.ranks}, cost=cost_cfg,
                   batch={"seq_len": a.seq_len, "micro_batches": a.micro_batches},
                   outliers={"min_length": 0.5 if delay else 0})
        with DataService.start(cfg, n_workers=a.dask_workers, threads_per_worker=1) as svc:
            if a.nice_loaders:
                svc.client.run(renice, a.nice_loaders)
            run = dict(args, address=svc.client.scheduler.address, name="benchtrain",
                       prefetch=prefetch, report=report)
            raw[label] = train("msd", run)
            planner[label] = svc.stats()["planner"]
    # α, β as the ranks ran: every pipeline's (ΣL, ΣL², forward+backward CPU time) per rank-step
    from msd_dask.core.cost import CostFitter

    situ = CostFitter(min_observations=1, prior_weight=0.0)
    for ranks in raw.values():
        for r in ranks:
            for rec in r["recs"]:
                situ.observe(np.array(rec["segs"], dtype=np.int64), rec["cpu"])
    fit = situ.model()
    cost = (fit.linear, fit.quadratic)
    results = {name: summarize(ranks, cost) for name, ranks in raw.items()}
    secs = time.perf_counter() - t0
    params = next(iter(results.values()))["params"]
    print(f"{a.ranks} ranks (gloo, 1 thread each), {a.layers} layers d={a.d_model} "
          f"({params / 1e6:.2f}M params), {a.micro_batches} x {a.seq_len} tokens per rank-step, "
          f"{a.steps} timed steps after {a.warmup}; baseline {a.loader_workers} loader worker(s)/rank; "
          f"msd_dask {a.dask_workers} dask workers; {os.cpu_count()} cores; {secs:.0f} s"
          + (f"; loaders' processes at nice {a.nice_loaders}" if a.nice_loaders else ""))
    ratio_cfg = base["cost"]["quadratic"] / base["cost"]["linear"]
    if cal is not None:
        print(f"calibrated forward+backward of this model (1 thread, {len(cal['rows'])} rows of "
              f"known segments): α = {cal['alpha'] * 1e6:.2f} µs/token, β = "
              f"{cal['beta'] * 1e9:.2f} ns/token², β/α = {cal['beta'] / cal['alpha']:.2e} "
              f"(config: {ratio_cfg:.2e}); worst row off by {cal['max_rel_error']:.0%}")
    print(f"fitted to the ranks' own forward+backward CPU times in this run ({situ.count} rank-steps): "
          f"α = {cost[0] * 1e6:.2f} µs/token, β = {cost[1] * 1e9:.2f} ns/token², "
          f"β/α = {cost[1] / cost[0]:.2e}; the model and bound columns use these")
    print(f"{'pipeline':<26}{'steps/s':>9}{'tokens/s':>10}{'allreduce':>11}{'wait':>7}{'cpu wait':>9}"
          f"{'floor':>7}{'data':>7}{'fwd+bwd':>9}{'imbal':>7}{'cpu':>7}{'model':>7}{'bound':>7}"
          f"{'fill':>6}{'ΣL²/tok':>9}")
    for name, r in results.items():
        print(f"{name:<26}{r['steps_per_s']:>9.2f}{r['tokens_per_s']:>10,.0f}"
              f"{r['allreduce_share']:>11.1%}{r['wait_share']:>7.1%}{r['cpu_wait_share']:>9.1%}"
              f"{r['noise_floor']:>7.1%}"
              f"{r['data_share']:>7.1%}"
              f"{r['compute_share']:>9.1%}{r['compute_imbalance']:>7.3f}{r['cpu_imbalance']:>7.3f}"
              f"{r['model_imbalance']:>7.3f}{r['bound']:>7.3f}{r['fill']:>6.0%}{r['span']:>9,.0f}")
    for name, ranks in raw.items():  # how much of a rank-step's CPU time no such model explains
        e2, _ = residual(ranks, False)
        e3, c3 = residual(ranks, True)
        print(f"{name}: CPU time per rank-step off its own α·ΣL + β·ΣL² fit by {e2:.1%} rms; "
              f"with a per-segment term {e3:.1%} (γ = {c3[2] * 1e3:.2f} ms per segment)")
    hf = results["HF streaming (per rank)"]
    print("no-wait all-reduce of the gradients: " + ", ".join(
        f"{r['pure_allreduce_ms']:.2f} ms ({name})" for name, r in results.items()))
    for name, st in planner.items():
        cm = st["cost_model"]
        print(f"{name}: planner imbalance under its own model {st['mean_imbalance']:.3f}; final model "
              f"β/α = {cm['quadratic'] / cm['linear']:.2e}"
              + (f" (fitted, {cm['observations']} rank-step reports)" if cm["fitted"] else ""))
    for name, msd in results.items():
        if name == next(iter(results)):
            continue
        print(f"ratio {name} / HF: steps/s {msd['steps_per_s'] / hf['steps_per_s']:.2f}, "
              f"tokens/s {msd['tokens_per_s'] / hf['tokens_per_s']:.2f}, wait share "
              f"{msd['wait_share'] / hf['wait_share'] if hf['wait_share'] else math.nan:.2f}")
    for name, msd in results.items():
        if name != next(iter(results)):
            print(f"goal: all-reduce wait <= {GOAL_WAIT:.0%} of step time with msd_dask; {name}: "
                  f"{msd['wait_share']:.1%} measured "
                  f"({'met' if msd['wait_share'] <= GOAL_WAIT else 'not met'}), "
                  f"{msd['cpu_wait_share']:.1%} implied by the CPU times; a perfect plan would "
                  f"leave {msd['noise_floor']:.1%} on ranks this noisy")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"calibration": cal, "in_situ": {"alpha": cost[0], "beta": cost[1]},
                       "results": results, "planner": planner,
                       # per pipeline, rank and timed step: segment lengths and CPU seconds
                       "rank_steps": {name: [[{"segs": r["segs"], "cpu": r["cpu"]}
                                              for r in rank["recs"]] for rank in ranks]
                                      for name, ranks in raw.items()}}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
