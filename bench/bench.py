"""Training and decoding speed, peak memory and MFU of minitransformer against the same model
in PyTorch, measured in one run.

    python bench/bench.py --config tiny          # ~2-3 minutes on 2 cores
    python bench/bench.py --config base-lite     # ~5 minutes with the default 3 + 8 steps
    python bench/bench.py --all                  # both; then bench/RESULTS.md
    python bench/bench.py --all --device cuda     # CuPy against torch on CUDA (eager), + base
    python bench/bench.py --all --device cuda --precision float16   # mixed precision, both sides
    python bench/bench.py --all --ranks 2        # also 2 ranks x 1 thread each (train, decode)

How it measures (details in bench/RESULTS.md, "Method"):
* Each framework runs in its own worker process (so ru_maxrss is its own peak); the parent
  drives both step by step and alternates them (ours, torch, torch, ours, ...), so noise from
  other processes on the machine hits both alike. The idle worker waits on a pipe, and each
  timed call starts 0.25 s after the last one ended, when the threads a worker leaves
  spinning (OpenBLAS's, about 0.1 s) have gone to sleep.
* Both get the same synthetic batches (built from one seed in each worker; their hashes are
  compared) and the same initial weights (ours writes them, torch loads them), and their
  no-dropout loss on the first batch is compared before training starts.
* Training: one step = forward, backward of loss_sum / n_tokens, Adam (0.9, 0.98, 1e-9) with
  the paper's learning rate at that step; ours is train.py's own update (mt/step.py: backward
  of loss_sum, the gradient then divided by n_tokens). Target tokens/s = non-padding target
  tokens / step time; median over the steps after the warm-up ones.
* ``--ranks N`` adds two workers of N processes with one thread each, bound to one core
  each: ours under mpiexec with the package's MPI all-reduce, exactly as
  ``mpiexec -n N python train.py`` trains, and torch with DistributedDataParallel over gloo.
  Each rank takes its share of the same batches (``common.shard_rows``). They join the
  step-by-step alternation; their peak memory is the sum over the ranks. They decode too,
  as translate.py's worker processes do: each rank every N-th sentence of each batch.
* Decoding: the initial weights are reloaded; greedy and beam (4, alpha 0.6) search with a
  key/value cache on the same sentences, batched as translate.py does. Maximum length =
  source length + ``--max-len-a`` (default 0): an untrained model rarely emits EOS, so both
  decode (nearly) every sentence to that length, which is about a real translation's length.
"""
import os
import sys

if sys.argv[1:3] != ["--worker", "torch"]:
    # BLAS core type, malloc and TF32 as train.py sets them, before numpy loads OpenBLAS (the
    # torch worker inherits the environment; it imports only the batching helpers).
    import minitransformer
    minitransformer.configure_process()

import argparse
import datetime
import importlib.util
import json
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
import traceback

import numpy as np

import common
import report

HERE = os.path.dirname(os.path.abspath(__file__))
WARMUP_LR_STEPS = 4000  # the paper's warm-up, for noam_lr; both frameworks use the same lr
# Pause before each timed call: a worker's BLAS or OpenMP threads keep spinning after its last
# call (NumPy's OpenBLAS for about 0.1 s, measured: 0.1 s of CPU in an idle 0.2 s; PyTorch's
# libgomp about 0.01 s), and would take a core from whichever worker is timed next.
SETTLE_SECONDS = 0.25


# ==== workers ==================================================================================
class Runner:
    """What both workers share: data, step bookkeeping. Subclasses supply the framework."""

    def __init__(self, args, mpi=None):
        self.args, self.name = args, args.config
        self.mpi = mpi  # an mpi4py communicator when run as data-parallel ranks (--ranks)
        spec = common.CONFIGS[args.config]
        self.cfg = {**common.model_config(args.config), "max_positions": 1024}
        n_batches = args.warmup + args.steps
        V = self.cfg["vocab_size"]
        self.batches = common.training_batches(n_batches, V, args.max_tokens or spec["max_tokens"],
                                               args.seed)
        self.decode_srcs = common.decode_batches(args.decode_sentences, V, args.seed + 1,
                                                 args.decode_max_tokens)
        self.step_count = 0

    def imports(self):
        """Import the framework's libraries (before setup's memory reading)."""

    def setup(self):
        fp = common.fingerprint([a for b in self.batches for a in b.values()])
        fp_dec = common.fingerprint(self.decode_srcs)
        self.imports()  # (the framework's libraries count in the setup, not in the growth)
        rss_data = common.max_rss_mib()
        self.build()
        return dict(batches=fp, decode=fp_dec, rss_setup_mib=rss_data,
                    n_params=self.n_params(), **self.versions())

    def train_step(self, i):
        b = self.batches[i % len(self.batches)]
        self.step_count += 1
        lr = noam_lr(self.step_count, self.cfg["d_model"], WARMUP_LR_STEPS)
        self.sync()
        t0 = time.perf_counter()
        loss, n = self.step(b, lr)
        self.sync()
        dt = time.perf_counter() - t0
        B, S = b["src"].shape
        T = b["tgt_in"].shape[1]
        return dict(seconds=dt, loss_per_token=loss / n, tokens=n, B=B, S=S, T=T,
                    src_tokens=int((b["src"] != self.cfg["pad_id"]).sum()))

    def decode(self, kind, warmup=False):
        """Translate the decoding batches -> seconds, outputs. As ranks, each rank
        translates every size-th sentence of each batch (its share, cut to its longest
        source: translate.py's workers deal sentences out so) between two barriers; rank 0
        times it and gathers the outputs back into their places."""
        srcs = [self.decode_srcs[0][:8]] if warmup else self.decode_srcs
        mpi, pad = self.mpi, self.cfg["pad_id"]
        mine = srcs
        if mpi is not None:
            mine = [common.trim(src[mpi.rank::mpi.size], pad) for src in srcs]
            mpi.Barrier()
        outs = []
        self.sync()
        t0 = time.perf_counter()
        for src in mine:
            outs.append(self.search(kind, src) if len(src) else [])
        self.sync()
        if mpi is not None:
            mpi.Barrier()
        dt = time.perf_counter() - t0
        if mpi is not None:
            shares = mpi.gather(outs, root=0)
            if mpi.rank != 0:
                return {}
            outs = []
            for b, src in enumerate(srcs):
                merged = [None] * len(src)
                for r, share in enumerate(shares):
                    merged[r::mpi.size] = share[b]
                outs.append(merged)
        out = [o for batch in outs for o in batch]
        return dict(seconds=dt, sentences=sum(len(s) for s in srcs),
                    out_tokens=sum(len(o) for o in out), outputs=out)

    def quit(self):
        return dict(bye=True)


def rank_memory(mpi):
    """Peak RSS of this worker; with ranks, their sum (and each rank's), gathered on rank 0."""
    rss = common.max_rss_mib()
    if mpi is None:
        return dict(max_rss_mib=rss)
    every = mpi.gather(rss, root=0)
    return dict(max_rss_mib=sum(every), per_rank_mib=every) if mpi.rank == 0 else {}


def noam_lr(step, d_model, warmup):
    """The package's schedule (imported in the ours worker, written out in the torch one)."""
    step = max(int(step), 1)
    return d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


class OursRunner(Runner):
    def imports(self):
        import minitransformer.nn.transformer  # noqa: F401
        import minitransformer.optim  # noqa: F401
        if self.args.device == "cuda":
            import cupy  # noqa: F401

    def build(self):
        import minitransformer.nn.transformer as tr
        from minitransformer.optim import Adam, noam_lr as package_lr
        assert package_lr(7, 512, 4000) == noam_lr(7, 512, 4000)
        self.device = self.args.device
        common.set_blas_threads(self.args.threads)
        if self.device == "cuda":
            import cupy
            self.sync = lambda: cupy.cuda.Device().synchronize()
            self.xp = cupy
        else:
            self.sync = lambda: None
            self.xp = np
        cfg = tr.TransformerConfig.from_dict(self.cfg)
        half = self.args.precision == "float16"  # as train.py --precision float16
        self.model = tr.Transformer(cfg, seed=self.args.seed, device=self.device,
                                    compute_dtype=np.float16 if half else None)
        self.scaler = None
        if half:
            from minitransformer.optim import DynamicLossScaler
            self.scaler = DynamicLossScaler()
        self.opt = Adam(self.model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
        self.comm = None
        if self.mpi is not None:  # data-parallel ranks, exactly as train.py runs them
            from minitransformer.mt.distributed import Comm
            from mpi4py import MPI
            self.comm = Comm(MPI, self.mpi, device="cpu")
            self.comm.broadcast_params(self.model.parameters())
            self.model.rng.seed(self.args.seed * 1000 + self.comm.rank)  # own dropout masks
        elif self.args.init:  # the torch workers start from these weights
            np.savez(self.args.init, **{k: v for k, v in self.model.state_dict().items()})

    def n_params(self):
        return int(sum(p.size for p in self.model.parameters()))

    def versions(self):
        import minitransformer
        out = dict(framework=f"minitransformer {minitransformer.__version__}",
                   numpy=np.__version__, blas=common.openblas_info(),
                   environment={k: os.environ.get(k) for k in
                                ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")})
        if self.device == "cuda":  # which GPU (the report names it in the machine's block)
            import cupy
            rt = cupy.cuda.runtime
            name = rt.getDeviceProperties(cupy.cuda.Device().id)["name"]
            out["gpu"] = dict(name=name.decode() if isinstance(name, bytes) else str(name),
                              cupy=cupy.__version__, cuda_runtime=rt.runtimeGetVersion())
        return out

    def step(self, b, lr):
        """train.py's update (minitransformer/mt/step.py) on batch b, this rank's rows of it
        under --ranks (an empty share still joins the all-reduce)."""
        from minitransformer.mt.step import train_step
        if self.comm is not None:
            b = common.shard_rows(b, self.comm.rank, self.comm.size, self.cfg["pad_id"])
        result = train_step(self.model, self.opt, [] if b is None else [b], lr,
                            scaler=self.scaler, comm=self.comm)
        return result.loss_sum, result.tokens

    def eval_loss(self, i=0):
        from minitransformer import no_grad
        b = self.batches[i]
        self.model.eval()
        with no_grad():
            loss, n = self.model.loss(b["src"], b["tgt_in"], b["tgt_out"])
        self.model.train()
        return dict(loss_per_token=float(loss.data) / n, tokens=n)

    def memory(self):
        out = rank_memory(self.mpi)
        if self.device == "cuda":
            import cupy
            pool = cupy.get_default_memory_pool()
            # the pool keeps freed blocks, so what it holds after training is its high-water
            # mark (the analogue of torch's max_memory_reserved)
            out.update(gpu_reserved_mib=pool.total_bytes() / 2 ** 20,
                       gpu_used_mib=pool.used_bytes() / 2 ** 20)
        return out

    def profile(self, steps=3, top=15):
        """``steps`` training steps under the package's profiler (engine/profiler.py): time,
        FLOPs, GFLOP/s and MFU (against its own measured GEMM rate) per op and per module.
        -> the ``top`` ops as rows, and both tables as text."""
        from minitransformer.engine.profiler import Profiler
        prof = Profiler(self.model)
        t0 = time.perf_counter()
        for i in range(steps):
            b = self.batches[i % len(self.batches)]
            self.step_count += 1
            lr = noam_lr(self.step_count, self.cfg["d_model"], WARMUP_LR_STEPS)
            with prof:
                self.step(b, lr)
                self.sync()
        wall = time.perf_counter() - t0
        peak = prof.peak()
        rows = [dict(function=name, calls=s.calls, forward_s=s.forward_s, backward_s=s.backward_s,
                     tottime=s.seconds, cumtime=s.seconds, gflop=s.flops / 1e9,
                     mfu=s.flops / s.seconds / 1e9 / peak if s.seconds > 0 else 0.0,
                     mb=s.bytes / 1e6) for name, s in prof.rows("op")[:top]]
        text = prof.table("op", top) + "\n\n" + prof.table("module", top, depth=3)
        return dict(steps=steps, wall_seconds=wall, total_tt=prof.total_seconds(), rows=rows,
                    text=text, profiler="minitransformer.engine.profiler", peak_gflops=peak,
                    gflop=prof.total_flops() / 1e9)

    def reset(self):
        self.model.load_state_dict(np.load(self.args.init))
        return {}

    def search(self, kind, src):
        from minitransformer.mt.search import beam_search, greedy_search
        if kind == "greedy":
            return greedy_search(self.model, src, max_len_a=self.args.max_len_a)
        return beam_search(self.model, src, beam=self.args.beam, alpha=0.6,
                           max_len_a=self.args.max_len_a)

    def gemm(self, n=None):
        if self.device == "cuda":
            import cupy
            n = n or 8192
            dtype = cupy.float16 if self.args.precision == "float16" else cupy.float32
            make = lambda n: cupy.random.standard_normal((n, n), dtype=cupy.float32  # noqa
                                                         ).astype(dtype)
            return dict(gflops=common.gemm_gflops(cupy.matmul, make, n, 5, self.sync), n=n,
                        dtype=np.dtype(dtype).name)
        n = n or 2048
        return dict(gflops=common.numpy_gemm_gflops(n), n=n)


class TorchRunner(Runner):
    def imports(self):
        import torch  # noqa: F401
        import torch_reference  # noqa: F401

    def build(self):
        import torch
        import torch_reference as ref
        self.torch, self.ref = torch, ref
        torch.set_num_threads(self.args.threads)
        torch.manual_seed(self.args.seed)
        self.device = torch.device(self.args.device)
        self.scaler = None
        if self.device.type == "cuda":
            self.sync = torch.cuda.synchronize
            # float32 products in TF32 exactly when ours use it (CUPY_TF32, set by
            # minitransformer.backend unless the environment says otherwise)
            torch.backends.cuda.matmul.allow_tf32 = os.environ.get("CUPY_TF32", "1") == "1"
            if self.args.precision == "float16":  # autocast + GradScaler, PyTorch's AMP
                self.scaler = torch.amp.GradScaler("cuda")
        else:
            self.sync = lambda: None
        self.model = ref.Transformer(self.cfg)
        self.model.load_minitransformer_state(np.load(self.args.init))
        self.model.to(self.device)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9)
        self.ddp = None
        if self.mpi is not None:  # the PyTorch way: DistributedDataParallel over gloo
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{self.args.port}",
                                    rank=self.mpi.rank, world_size=self.mpi.size)
            torch.manual_seed(self.args.seed * 1000 + self.mpi.rank)  # own dropout masks
            self.ddp = DistributedDataParallel(ref.LossOf(self.model))

    def n_params(self):
        return int(sum(p.numel() for p in self.model.parameters()))

    def versions(self):
        t = self.torch
        return dict(framework=f"torch {t.__version__}", threads=t.get_num_threads(),
                    interop_threads=t.get_num_interop_threads(),
                    parallel_info=t.__config__.parallel_info().strip().splitlines()[:8],
                    mkldnn=bool(t.backends.mkldnn.is_available()),
                    cuda=t.version.cuda if self.device.type == "cuda" else None)

    def _tensors(self, b):
        return [self.torch.from_numpy(b[k]).to(self.device) for k in ("src", "tgt_in", "tgt_out")]

    def step(self, b, lr):
        self.model.train()
        if self.ddp is not None:
            import torch.distributed as dist
            shard = common.shard_rows(b, self.mpi.rank, self.mpi.size, self.cfg["pad_id"])
            # DDP needs a forward on every rank: a rank without rows runs one, weighted 0
            src, tgt_in, tgt_out = self._tensors(shard if shard is not None else
                                                 {k: a[:1] for k, a in b.items()})
            mine = 0.0 if shard is None else float((shard["tgt_out"] != self.cfg["pad_id"]).sum())
            n_all = self.torch.tensor(mine)
            dist.all_reduce(n_all)  # the global token count, to divide the summed loss by
            loss, n = self.ddp(src, tgt_in, tgt_out)
            if shard is None:
                loss = loss * 0.0
            # DDP averages gradients over ranks: size * loss_sum / n_all gives sum / n_all
            (loss * (self.mpi.size / n_all)).backward()
            loss_all = loss.detach().clone()
            dist.all_reduce(loss_all)
            for g in self.opt.param_groups:
                g["lr"] = lr
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            return loss_all.item(), int(n_all.item())
        src, tgt_in, tgt_out = self._tensors(b)
        for g in self.opt.param_groups:
            g["lr"] = lr
        if self.scaler is not None:
            with self.torch.autocast("cuda", dtype=self.torch.float16):
                loss, n = self.model.loss(src, tgt_in, tgt_out)
            self.scaler.scale(loss / n).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.opt.zero_grad(set_to_none=True)
            return loss.item(), n
        loss, n = self.model.loss(src, tgt_in, tgt_out)
        (loss / n).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item(), n

    def eval_loss(self, i=0):
        b = self.batches[i]
        self.model.eval()
        with self.torch.no_grad():
            src, tgt_in, tgt_out = self._tensors(b)
            loss, n = self.model.loss(src, tgt_in, tgt_out)
            hand = self.ref.smoothed_cross_entropy_by_hand(self.model(src, tgt_in), tgt_out,
                                                           self.cfg["label_smoothing"],
                                                           self.cfg["pad_id"])
        self.model.train()
        return dict(loss_per_token=float(loss) / n, tokens=n, by_hand_per_token=float(hand) / n)

    def memory(self):
        out = rank_memory(self.mpi)
        if self.device.type == "cuda":
            c = self.torch.cuda
            out.update(gpu_reserved_mib=c.max_memory_reserved() / 2 ** 20,
                       gpu_used_mib=c.max_memory_allocated() / 2 ** 20)
        return out

    def reset(self):
        self.model.load_minitransformer_state(np.load(self.args.init))
        return {}

    def search(self, kind, src):
        src = self.torch.from_numpy(src).to(self.device)
        if self.args.precision == "float16":  # as ours decodes then: in float16 (autocast)
            with self.torch.autocast("cuda", dtype=self.torch.float16):
                return self._search(kind, src)
        return self._search(kind, src)

    def _search(self, kind, src):
        if kind == "greedy":
            return self.ref.greedy_search(self.model, src, max_len_a=self.args.max_len_a)
        return self.ref.beam_search(self.model, src, beam=self.args.beam, alpha=0.6,
                                    max_len_a=self.args.max_len_a)

    def gemm(self, n=None):
        t = self.torch
        n = n or (8192 if self.device.type == "cuda" else 2048)
        dtype = t.float16 if self.args.precision == "float16" else t.float32
        make = lambda n: t.randn(n, n, device=self.device, dtype=dtype)  # noqa: E731
        return dict(gflops=common.gemm_gflops(t.matmul, make, n, 5, self.sync), n=n)


class _Pieces:
    """What ct2_spec.model_spec reads of a tokenizer, for the bench's made-up vocabulary."""

    def __init__(self, vocab):
        self.vocab, self.vocab_size, self.unk_id = vocab, len(vocab), 1

    def id_to_piece(self, i):
        return self.vocab[i]


class CT2Runner(Runner):
    """Decoding only: the same initial weights, exported to CTranslate2 float32
    (``minitransformer.export``) and searched by ``ctranslate2.Translator`` with
    ``--threads`` intra-op threads. Token ids become the strings of a made-up vocabulary
    ("<blank>", "<unk>", "<s>", "</s>", "t4", ...). CTranslate2 takes one maximum output
    length per call, so each batch is split into groups of equal maximum length (ours:
    source length + --max-len-a per sentence); the options are export.search_options', so
    greedy search is token for token ours."""

    def build(self):
        import ctranslate2
        import minitransformer.nn.transformer as tr
        from minitransformer.ct2_spec import model_spec
        self.sync, self.ct2 = (lambda: None), ctranslate2
        model = tr.Transformer(tr.TransformerConfig.from_dict(self.cfg))
        model.load_state_dict(np.load(self.args.init))
        V = self.cfg["vocab_size"]
        self.vocab = ["<blank>", "<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(4, V)]
        self.dir = tempfile.mkdtemp(prefix="minitransformer-bench-ct2-")
        spec = model_spec(model, _Pieces(self.vocab), ctranslate2)
        spec.validate()
        spec.save(self.dir)
        self.translator = ctranslate2.Translator(self.dir, device="cpu",
                                                 inter_threads=1,
                                                 intra_threads=self.args.threads)
        self.index = {t: i for i, t in enumerate(self.vocab)}

    def n_params(self):
        return int(sum(np.prod(s) for s in (np.load(self.args.init)[k].shape
                                            for k in np.load(self.args.init).files)))

    def versions(self):
        return dict(framework=f"ctranslate2 {self.ct2.__version__}",
                    intra_threads=self.args.threads)

    def reset(self):
        return {}

    def search(self, kind, src):
        from minitransformer.export import search_options
        c = self.cfg
        pad, eos = c["pad_id"], c["eos_id"]
        rows = [[self.vocab[i] for i in row if i not in (pad, eos)] for row in src.tolist()]
        out = [None] * len(rows)
        for n in sorted({len(r) for r in rows}):  # one maximum output length a call
            group = [i for i, r in enumerate(rows) if len(r) == n]
            # greedy: exactly ours (pad and BOS suppressed, EOS allowed at once); beam: the
            # power length penalty with alpha 0.6, where ours and torch use GNMT's
            opts = search_options(c["max_positions"], self.vocab[pad], self.vocab[c["bos_id"]],
                                  n, 1 if kind == "greedy" else self.args.beam, 0.6,
                                  self.args.max_len_a)
            res = self.translator.translate_batch([rows[i] for i in group], **opts)
            for i, r in zip(group, res):
                out[i] = [self.index[t] for t in r.hypotheses[0]]
        return out

    def quit(self):
        shutil.rmtree(self.dir, ignore_errors=True)
        return dict(bye=True)


CMD_TAG = 7


def worker_main(args):
    mpi = None
    if args.ranks > 1:  # started by mpiexec: rank 0 talks to the parent, the others follow
        from mpi4py import MPI
        mpi = MPI.COMM_WORLD
    lead = mpi is None or mpi.rank == 0
    proto = os.fdopen(os.dup(1), "w")  # the protocol channel; stray prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    runner = dict(ours=OursRunner, torch=TorchRunner, ctranslate2=CT2Runner)[args.worker](args,
                                                                                       mpi)
    while True:
        if lead:
            line = sys.stdin.readline()
            cmd = json.loads(line) if line else dict(op="quit")
            for r in range(1, mpi.size if mpi else 1):
                mpi.send(cmd, dest=r, tag=CMD_TAG)
        else:
            # Sleep between polls: a blocking receive would spin a core at 100% while the
            # other workers are being timed.
            while not mpi.Iprobe(source=0, tag=CMD_TAG):
                time.sleep(0.001)
            cmd = mpi.recv(source=0, tag=CMD_TAG)
        try:
            result = getattr(runner, cmd["op"])(**cmd.get("kw", {}))
        except Exception:
            if mpi is not None:  # the other ranks may be waiting in a collective: stop all
                traceback.print_exc()
                sys.stderr.flush()
                mpi.Abort(1)
            result = dict(error=traceback.format_exc())
        if lead:
            proto.write(json.dumps(result) + "\n")
            proto.flush()
        if cmd["op"] == "quit":
            break


# ==== the parent ===============================================================================
class Worker:
    """A worker process driven over its stdin/stdout, one JSON line per command and reply.
    With ranks > 1: ``ranks`` processes under mpiexec, one BLAS/torch thread each, bound to
    one core each (the set-up the Multi30k recipe trains with)."""

    def __init__(self, fw, argv, ranks=1, label=None):
        self.fw = label or fw
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", fw, *argv]
        env = None
        if ranks > 1:
            cmd = [find_mpiexec(), "-n", str(ranks), "--bind-to", "core", *cmd,
                   "--ranks", str(ranks), "--threads", "1", "--port", str(free_port())]
            env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
            if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root otherwise
                env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1, env=env)

    def __call__(self, op, **kw):
        self.proc.stdin.write(json.dumps(dict(op=op, kw=kw)) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.fw} worker exited (code {self.proc.wait()}) "
                               f"during {op!r}; its error is above")
        result = json.loads(line)
        if "error" in result:
            raise RuntimeError(f"{self.fw} worker, {op!r}:\n{result['error']}")
        return result

    def close(self):
        if self.proc.poll() is None:
            try:
                self("quit")
            except Exception:
                pass
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def find_mpiexec():
    """Open MPI's mpiexec: beside this Python (a venv's bin/, where `pip install -e .[mpi]`
    puts it), else on PATH; None without it or without mpi4py."""
    if importlib.util.find_spec("mpi4py") is None:
        return None
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


def free_port():
    """A TCP port on loopback that is free now (for torch.distributed's gloo rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def agreement(a, b):
    same = sum(x == y for x, y in zip(a, b))
    return dict(identical=same, of=len(a))


def run_config(name, args, machine, peak):
    spec = common.CONFIGS[name]
    steps = args.steps if args.steps is not None else spec["steps"]
    warmup = args.warmup if args.warmup is not None else spec["warmup"]
    n_dec = args.decode_sentences or spec["decode_sentences"]
    # (a tiny model's search of 128 sentences takes ~0.1 s: one such run on a shared machine
    # is noisy, so its median is taken over more of them)
    reps = args.decode_reps or spec["decode_reps"]
    max_tokens = args.max_tokens or spec["max_tokens"]
    frameworks = ["ours"] + (["torch"] if args.torch else [])
    ranked = [fw + "_ranks" for fw in frameworks] if args.ranks > 1 else []
    tmp = tempfile.mkdtemp(prefix="minitransformer-bench-")
    init = os.path.join(tmp, "init.npz")
    argv = ["--config", name, "--device", args.device, "--seed", str(args.seed),
            "--steps", str(steps), "--warmup", str(warmup), "--decode-sentences", str(n_dec),
            "--decode-max-tokens", str(args.decode_max_tokens), "--beam", str(args.beam),
            "--max-len-a", str(args.max_len_a), "--threads", str(args.threads),
            "--precision", args.precision, "--init", init, "--max-tokens", str(max_tokens)]
    cfg = common.model_config(name)
    print(f"\n== {name}: N={cfg['n_layers']} D={cfg['d_model']} H={cfg['n_heads']} "
          f"F={cfg['d_ff']} V={cfg['vocab_size']}, ~{max_tokens} + {max_tokens} "
          f"tokens a batch, {warmup} warm-up + {steps} timed steps, device {args.device}",
          flush=True)
    res = dict(config=name, model=cfg, device=args.device, date=_now(), machine=machine,
               code=_code_version(),
               peak=peak, settings=dict(steps=steps, warmup=warmup, decode_sentences=n_dec,
                                        decode_max_tokens=args.decode_max_tokens,
                                        beam=args.beam, alpha=0.6, max_len_a=args.max_len_a,
                                        threads=args.threads, seed=args.seed,
                                        max_tokens=max_tokens, ranks=args.ranks,
                                        precision=args.precision))
    workers = {}
    try:
        workers["ours"] = Worker("ours", argv)
        setup = {"ours": workers["ours"]("setup")}
        if args.torch:
            workers["torch"] = Worker("torch", argv)
            setup["torch"] = workers["torch"]("setup")
            for key in ("batches", "decode", "n_params"):
                if setup["ours"][key] != setup["torch"][key]:
                    raise RuntimeError(f"the workers disagree on {key}: {setup['ours'][key]} "
                                       f"vs {setup['torch'][key]}")
        for fw in ranked:
            workers[fw] = Worker(fw[:-len("_ranks")], argv, ranks=args.ranks, label=fw)
            setup[fw] = workers[fw]("setup")
            for key in ("batches", "decode", "n_params"):
                if setup[fw][key] != setup["ours"][key]:
                    raise RuntimeError(f"the {fw} worker disagrees on {key}")
        res["setup"] = setup
        print(f"   {setup['ours']['n_params']:,} parameters; batches {setup['ours']['batches']} "
              f"identical in all {len(setup)} workers"
              + (f" ({', '.join(ranked)}: {args.ranks} processes x 1 thread)" if ranked else ""),
              flush=True)

        res["initial_loss"] = {fw: workers[fw]("eval_loss") for fw in frameworks}
        if args.torch:
            a, b = (res["initial_loss"][fw]["loss_per_token"] for fw in frameworks)
            res["initial_loss"]["rel_diff"] = abs(a - b) / abs(b)
            print(f"   initial loss (no dropout): ours {a:.6f}, torch {b:.6f} "
                  f"(rel. diff {abs(a - b) / abs(b):.1e}; torch by hand "
                  f"{res['initial_loss']['torch']['by_hand_per_token']:.6f})", flush=True)

        # ---- training, alternating who goes first ----
        trainers = frameworks + ranked
        train = {fw: [] for fw in trainers}
        for i in range(warmup + steps):
            order = trainers if i % 2 == 0 else trainers[::-1]
            for fw in order:
                time.sleep(SETTLE_SECONDS)
                train[fw].append(workers[fw]("train_step", i=i))
            r = train["ours"][-1]
            msg = f"   step {i + 1:2d}/{warmup + steps}{' (warm-up)' if i < warmup else ''}: " \
                  f"B={r['B']} S={r['S']} T={r['T']} | " + "  ".join(
                      f"{fw} {train[fw][-1]['seconds']:.3f} s "
                      f"({train[fw][-1]['tokens'] / train[fw][-1]['seconds']:,.0f} tok/s, "
                      f"loss {train[fw][-1]['loss_per_token']:.3f})" for fw in trainers)
            print(msg, flush=True)
        res["train"] = {fw: summarize_train(train[fw], warmup, cfg, peak) for fw in trainers}
        res["train_steps"] = train
        res["memory"] = {fw: workers[fw]("memory") for fw in trainers}
        for fw in trainers:
            res["memory"][fw]["rss_setup_mib"] = setup[fw]["rss_setup_mib"]
        if args.profile and name in args.profile:
            print("   profiling 3 training steps of ours (minitransformer's profiler) ...",
                  flush=True)
            res["profile"] = workers["ours"]("profile", steps=3, top=15)
            print(textwrap.indent(res["profile"]["text"], "   "), flush=True)

        res["gemm"] = {}
        for fw in frameworks:  # (one after the other, each after the pause, as the steps)
            time.sleep(SETTLE_SECONDS)
            res["gemm"][fw] = workers[fw]("gemm", n=args.gemm_size)

        # ---- decoding: one process each, and (--ranks) as ranks sharing out the sentences
        decoders = list(frameworks) + (ranked if args.device == "cpu" else [])
        for fw in ranked:
            if fw not in decoders:  # (done: on a GPU decoding is measured in one process)
                workers.pop(fw).close()
        for fw in decoders:
            workers[fw]("reset")
        if args.ct2 and args.device == "cpu" and importlib.util.find_spec("ctranslate2"):
            workers["ctranslate2"] = Worker("ctranslate2", argv)
            setup["ctranslate2"] = workers["ctranslate2"]("setup")
            decoders.append("ctranslate2")
        dec = {fw: {"greedy": [], "beam": []} for fw in decoders}
        outputs = {fw: {} for fw in decoders}
        for kind in ("greedy", "beam"):
            for fw in decoders:
                workers[fw]("decode", kind=kind, warmup=True)
            for rep in range(reps):
                order = decoders if rep % 2 == 0 else decoders[::-1]
                for fw in order:
                    time.sleep(SETTLE_SECONDS)
                    r = workers[fw]("decode", kind=kind)
                    outputs[fw].setdefault(kind, r.pop("outputs"))
                    dec[fw][kind].append(r)
                print(f"   {kind} rep {rep + 1}/{reps}: " + "  ".join(
                    f"{fw} {dec[fw][kind][-1]['seconds']:.2f} s "
                    f"({dec[fw][kind][-1]['sentences'] / dec[fw][kind][-1]['seconds']:.1f} sent/s,"
                    f" {dec[fw][kind][-1]['out_tokens']} tokens out)" for fw in decoders),
                    flush=True)
        res["decode"] = {fw: {kind: summarize_decode(dec[fw][kind]) for kind in dec[fw]}
                         for fw in decoders}
        res["decode_reps"] = dec
        if args.torch:
            res["decode_agreement"] = {kind: agreement(outputs["ours"][kind],
                                                       outputs["torch"][kind])
                                       for kind in ("greedy", "beam")}
        for fw in decoders:  # sharing the sentences out changes no output
            if fw.endswith("_ranks"):
                res.setdefault("decode_agreement_ranks", {})[fw] = {
                    kind: agreement(outputs[fw[:-len("_ranks")]][kind], outputs[fw][kind])
                    for kind in ("greedy", "beam")}
        if "ctranslate2" in decoders:
            res["decode_agreement_ctranslate2"] = {
                kind: agreement(outputs["ours"][kind], outputs["ctranslate2"][kind])
                for kind in ("greedy", "beam")}
    finally:
        for w in workers.values():
            w.close()
        if os.path.exists(init):
            os.remove(init)
        os.rmdir(tmp)
    res["ratios"] = ratios(res) if args.torch else None
    res["loadavg_end"] = os.getloadavg()
    return res


def summarize_train(steps, warmup, cfg, peak):
    timed = steps[warmup:]
    tps = [s["tokens"] / s["seconds"] for s in timed]
    fps = [common.train_flops(cfg, s["B"], s["S"], s["T"]) / s["seconds"] for s in timed]
    return dict(tokens_per_s=common.median(tps), seconds=common.median([s["seconds"]
                                                                          for s in timed]),
                tokens_per_step=common.median([s["tokens"] for s in timed]),
                flops_per_s=common.median(fps), mfu=common.median(fps) / (peak["gflops"] * 1e9),
                flops_per_target_token=common.median(
                    [common.train_flops(cfg, s["B"], s["S"], s["T"]) / s["tokens"]
                     for s in timed]))


def summarize_decode(reps):
    sps = [r["sentences"] / r["seconds"] for r in reps]
    return dict(sentences_per_s=common.median(sps), best_sentences_per_s=max(sps),
                seconds=common.median([r["seconds"] for r in reps]),
                sentences=reps[0]["sentences"], out_tokens=reps[0]["out_tokens"],
                reps=len(reps))


def ratios(res):
    o, t = res["train_steps"]["ours"], res["train_steps"]["torch"]
    w = res["settings"]["warmup"]
    per_step = [b["seconds"] / a["seconds"] for a, b in zip(o[w:], t[w:])]
    mem = res["memory"]
    out = dict(train=res["train"]["ours"]["tokens_per_s"] / res["train"]["torch"]["tokens_per_s"],
               train_per_step_median=common.median(per_step),
               greedy=res["decode"]["ours"]["greedy"]["sentences_per_s"]
               / res["decode"]["torch"]["greedy"]["sentences_per_s"],
               beam=res["decode"]["ours"]["beam"]["sentences_per_s"]
               / res["decode"]["torch"]["beam"]["sentences_per_s"],
               greedy_best=res["decode"]["ours"]["greedy"]["best_sentences_per_s"]
               / res["decode"]["torch"]["greedy"]["best_sentences_per_s"],
               beam_best=res["decode"]["ours"]["beam"]["best_sentences_per_s"]
               / res["decode"]["torch"]["beam"]["best_sentences_per_s"],
               memory=mem["ours"]["max_rss_mib"] / mem["torch"]["max_rss_mib"],
               memory_above_setup=(mem["ours"]["max_rss_mib"] - mem["ours"]["rss_setup_mib"])
               / (mem["torch"]["max_rss_mib"] - mem["torch"]["rss_setup_mib"]))
    if "ours_ranks" in res["train"] and "torch_ranks" in res["train"]:
        tps = {fw: t["tokens_per_s"] for fw, t in res["train"].items()}
        out.update(train_ranks=tps["ours_ranks"] / tps["torch_ranks"],
                   train_best=max(tps["ours"], tps["ours_ranks"])
                   / max(tps["torch"], tps["torch_ranks"]),
                   memory_ranks=mem["ours_ranks"]["max_rss_mib"]
                   / mem["torch_ranks"]["max_rss_mib"])
    dec = res["decode"]
    if "ours_ranks" in dec and "torch_ranks" in dec:
        for kind in ("greedy", "beam"):
            sps = {fw: d[kind]["sentences_per_s"] for fw, d in dec.items()}
            out[kind + "_ranks"] = sps["ours_ranks"] / sps["torch_ranks"]
            out[kind + "_best_setup"] = (max(sps["ours"], sps["ours_ranks"])
                                         / max(sps["torch"], sps["torch_ranks"]))
    if "gpu_reserved_mib" in mem["ours"]:
        out["gpu_memory"] = mem["ours"]["gpu_reserved_mib"] / mem["torch"]["gpu_reserved_mib"]
    return out


def print_summary(res):
    r, tr, dec, mem = res["ratios"], res["train"], res["decode"], res["memory"]
    fws = list(tr)
    print(f"\n-- {res['config']} ({res['device']}) --")
    print("   training target tok/s: " + ", ".join(f"{fw} {tr[fw]['tokens_per_s']:,.0f}"
                                                  for fw in fws)
          + (f"  -> ours/torch {r['train']:.2f}x (target >= 1.5x)" if r else ""))
    if r and "train_ranks" in r:
        n = res["settings"]["ranks"]
        print(f"   training with {n} ranks x 1 thread: ours/torch {r['train_ranks']:.2f}x; "
              f"best set-up of each: {r['train_best']:.2f}x (target >= 1.5x); peak RSS of "
              f"the ranks summed: ours/torch {r['memory_ranks']:.2f}x")
    fws = [fw for fw in fws if not fw.endswith("_ranks")]
    print("   MFU (vs {:.0f} GFLOP/s, {}): ".format(res["peak"]["gflops"], res["peak"]["how"])
          + ", ".join(f"{fw} {100 * tr[fw]['mfu']:.1f}%" for fw in fws))
    for kind in ("greedy", "beam"):
        print(f"   {kind} sent/s: " + ", ".join(f"{fw} {dec[fw][kind]['sentences_per_s']:.1f}"
                                                 for fw in dec)
              + (f"  -> ours/torch {r[kind]:.2f}x (target >= "
                 f"{report.target(kind, res['config'])}x; best of "
                 f"{dec['ours'][kind]['reps']}: {r[kind + '_best']:.2f}x)" if r else ""))
        if r and kind + "_ranks" in r:
            print(f"   {kind} with {res['settings']['ranks']} ranks x 1 thread: ours/torch "
                  f"{r[kind + '_ranks']:.2f}x; best set-up of each: "
                  f"{r[kind + '_best_setup']:.2f}x")
    grow = {fw: mem[fw]["max_rss_mib"] - mem[fw]["rss_setup_mib"] for fw in fws}
    print("   peak RSS MiB: " + ", ".join(f"{fw} {mem[fw]['max_rss_mib']:.0f} (+{grow[fw]:.0f} "
                                          f"over imports+data)" for fw in fws)
          + (f"  -> ours/torch {r['memory']:.2f}x (target <= 1), above setup "
             f"{r['memory_above_setup']:.2f}x" if r else ""))


def _code_version():
    """The commit measured, and whether the package had uncommitted changes."""
    try:
        run = lambda *c: subprocess.run(["git", *c], cwd=HERE, capture_output=True,  # noqa
                                        text=True, timeout=10).stdout.strip()
        return dict(commit=run("rev-parse", "--short", "HEAD"),
                    modified=run("status", "--short", "--", "../minitransformer").splitlines())
    except (OSError, subprocess.SubprocessError):
        return None


def _now():
    return datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(common.CONFIGS), action="append",
                   help="benchmark config (repeatable); default tiny")
    p.add_argument("--all", action="store_true",
                   help="every config: tiny and base-lite, and on --device cuda also base (the "
                        "paper's base model, V=37000)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="float32", choices=["float32", "float16"],
                   help="float16: mixed precision on both sides (ours as train.py --precision "
                        "float16, torch with autocast and GradScaler); needs --device cuda")
    p.add_argument("--steps", type=int, help="timed training steps (default: 20 tiny, 8 base-lite)")
    p.add_argument("--warmup", type=int, help="untimed warm-up steps (default 3)")
    p.add_argument("--max-tokens", type=int,
                   help="padded source (and target) tokens per training batch (default: the "
                        "config's, 2000 tiny, 4000 base-lite, 12000 base); smaller for a GPU "
                        "with little memory")
    p.add_argument("--decode-sentences", type=int,
                   help="sentences to translate (default: 128 tiny, 64 base-lite)")
    p.add_argument("--decode-reps", type=int,
                   help="timed repetitions of each search (default: 9 tiny, 3 base-lite and base)")
    p.add_argument("--decode-max-tokens", type=int, default=4096,
                   help="padded source tokens per decoding batch (translate.py's default)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--gemm-size", type=int,
                   help="n of the n x n x n float32 matmul that measures the device's peak, the "
                        "MFU denominator (default 8192 on cuda, 2048 on cpu)")
    p.add_argument("--max-len-a", type=int, default=0,
                   help="maximum output length = source length + this (default 0)")
    p.add_argument("--threads", type=int,
                   help="threads for numpy's OpenBLAS and for torch (default: what OpenBLAS "
                        "uses, normally one per core)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ranks", type=int, default=1,
                   help="also time training as N data-parallel processes with one thread each "
                        "(ours: mpiexec -n N, as train.py runs; torch: DistributedDataParallel "
                        "over gloo), and decoding as N processes sharing out the sentences, as "
                        "translate.py's workers do; needs pip install -e .[mpi]")
    p.add_argument("--no-torch", dest="torch", action="store_false",
                   help="measure minitransformer only")
    p.add_argument("--no-ctranslate2", dest="ct2", action="store_false",
                   help="skip CTranslate2: by default, where it is installed (pip install -e "
                        ".[deploy]), decoding on the CPU is timed with CTranslate2 float32 too, "
                        "on the same initial weights exported")
    p.add_argument("--ctranslate2", dest="ct2", action="store_true",
                   help=argparse.SUPPRESS)  # (the default; kept for older command lines)
    p.add_argument("--profile", nargs="*", default=["tiny"], metavar="CONFIG",
                   help="configs whose training step is profiled, op by op and module by "
                        "module (minitransformer's profiler: time, GFLOP/s, MFU; default tiny; "
                        "give none to skip)")
    p.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"),
                   help="report to write; raw results go to results/ beside it")
    # internal: run as a worker process
    p.add_argument("--worker", choices=["ours", "torch", "ctranslate2"], help=argparse.SUPPRESS)
    p.add_argument("--init", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def selected_configs(args):
    """The configs to run: --config's, or with --all every one (GPU-only ones on cuda)."""
    if args.all:
        return [c for c in common.CONFIGS if args.device == "cuda" or c not in common.GPU_ONLY]
    return args.config or ["tiny"]


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        args.config = args.config[0]
        return worker_main(args)
    configs = selected_configs(args)
    if args.torch and importlib.util.find_spec("torch") is None:
        sys.exit("PyTorch is needed for the comparison (bench-only, not a dependency): "
                 "pip install torch   -- or run with --no-torch to measure minitransformer only")
    if args.gemm_size is not None and args.gemm_size < 1:
        sys.exit(f"--gemm-size {args.gemm_size}: give a positive matrix size")
    if args.max_tokens is not None and args.max_tokens < 64:
        sys.exit(f"--max-tokens {args.max_tokens}: give at least 64 (a batch holds whole "
                 "sentences of 10-30 tokens)")
    if args.precision == "float16" and args.device != "cuda":
        sys.exit("--precision float16 needs --device cuda (on a CPU NumPy's float16 products "
                 "are slow and accumulate in float16)")
    if args.precision == "float16" and args.ranks > 1:
        sys.exit("--precision float16 is measured in one process: drop --ranks")
    if args.device == "cuda":
        from minitransformer.backend import get_xp
        get_xp("cuda")  # a clear error now if CuPy or the GPU is missing
    if args.ranks > 1 and find_mpiexec() is None:
        sys.exit("--ranks needs mpi4py and mpiexec: pip install -e \".[mpi]\"")
    if args.threads:
        common.set_blas_threads(args.threads)  # numpy here and in the ours worker
    args.threads = args.threads or common.blas_threads()
    machine = common.machine_info()
    print(f"machine: {machine['cpu']}, {machine['usable_cpus']} usable CPUs, load "
          f"{machine['loadavg']}; OpenBLAS {machine['blas'].get('corename')} "
          f"(OPENBLAS_CORETYPE={machine['blas'].get('OPENBLAS_CORETYPE')}), "
          f"{machine['blas'].get('threads')} threads; torch threads {args.threads}", flush=True)
    load = machine["loadavg"][0] if machine["loadavg"] else 0
    if args.threads > 1 and load > machine["usable_cpus"]:
        print(f"warning: load average {load:.1f} > {machine['usable_cpus']} CPUs: other "
              f"processes compete for the cores, and multi-threaded BLAS/OpenMP then waits for "
              f"descheduled threads (timings many times slower, mostly noise); consider "
              f"--threads 1", flush=True)
    n_gemm = args.gemm_size or 2048
    gflops = common.numpy_gemm_gflops(n_gemm)
    peak = dict(gflops=gflops, how=f"numpy float32 matmul {n_gemm}^3, best of 5", device="cpu")
    print(f"numpy float32 GEMM {n_gemm}^3: {gflops:.0f} GFLOP/s (the MFU denominator)",
          flush=True)
    if args.device == "cuda":
        peak = None  # measured in the ours worker with CuPy, below
    results_dir = report.results_dir(args.results)
    os.makedirs(results_dir, exist_ok=True)
    for name in configs:
        res = run_config(name, args, machine, peak or dict(gflops=float("nan")))
        if args.device == "cuda":  # MFU against CuPy's GEMM rate on the GPU
            g, gemm = res["gemm"]["ours"]["gflops"], res["gemm"]["ours"]
            res["peak"] = dict(gflops=g, how=f"cupy {gemm.get('dtype', 'float32')} matmul "
                               f"{gemm['n']}^3 (the run's precision)", device="cuda")
            for fw in res["train"]:
                res["train"][fw]["mfu"] = res["train"][fw]["flops_per_s"] / (g * 1e9)
        else:  # the best GEMM rate seen, at the start or after training (a shared machine)
            g = max(peak["gflops"], res["gemm"]["ours"]["gflops"])
            res["peak"] = dict(gflops=g, how=f"numpy float32 matmul {n_gemm}^3, best of 5 at the "
                               f"start ({peak['gflops']:.0f}) and 5 after training "
                               f"({res['gemm']['ours']['gflops']:.0f})", device="cpu")
            for fw in res["train"]:
                res["train"][fw]["mfu"] = res["train"][fw]["flops_per_s"] / (g * 1e9)
        prec = "" if args.precision == "float32" else f"-{args.precision}"
        path = os.path.join(results_dir, f"run-{name}-{args.device}{prec}-t{args.threads}.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print_summary(res)
        print(f"   raw results: {os.path.relpath(path)}")
    report.write(args.results)
    print(f"\nwrote {os.path.relpath(args.results)}")


if __name__ == "__main__":
    main()
