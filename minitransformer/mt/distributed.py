"""Data-parallel training: N processes, one per CPU socket or GPU, launched by ``mpiexec``.

    mpiexec -n 4 python train.py ...                  # CPU: gradients summed by MPI
    mpiexec -n 4 python train.py --device cuda ...    # one GPU per rank: summed by NCCL

Every rank builds the same model and reads the same stream of batches; at each update it takes
its share of every batch (``shard``: ``split_batch`` balances target tokens), runs forward and
backward on it, and then ``allreduce_grads`` sums, over all ranks, one flat buffer holding
every gradient, the loss and the target-token count (or, when the gradients already are one
buffer, Adam's flat one on a GPU, that buffer in place and then the loss and the count). The
Trainer divides the summed
gradients by the global token count, so each rank applies exactly the update a single
process would compute on the union of the ranks' shards (up to the order of float32
additions). Parameters are broadcast from rank 0 at the start, so all ranks stay identical.

Transport: on the CPU, mpi4py's ``Allreduce`` on NumPy buffers; on GPUs, CuPy's NCCL
communicator on device buffers, with MPI only to hand out NCCL's unique id, for barriers and
for the per-update stop decision. Only rank 0 writes logs and checkpoints.

Dropout: each rank needs its own masks, and a resumed run must draw the masks that the
uninterrupted run would have drawn, on every rank. Rather than saving N generator states,
each rank reseeds its dropout generator at every update from (seed, rank, update)
(``dropout_seed``), so the masks are a function of the update number alone.
"""
import contextlib
import os
import sys
import time
import traceback

import numpy as np

from .. import backend
from .data import split_batch

# Set by the launchers in every process they start: Open MPI, MPICH / Intel MPI (Hydra) and
# srun --mpi=pmi2, PMIx (srun --mpi=pmix, prterun), MVAPICH.
LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")
LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK",
                   "SLURM_LOCALID")
MPI_FIX = ("install MPI and mpi4py with `pip install -e .[mpi]` (mpi4py plus Open MPI's "
           "mpiexec, from PyPI), then launch with `mpiexec -n N python train.py ...`")
BUCKET_BYTES = 64 * 2 ** 20  # all-reduce the flat buffer in slices of at most this size


def launched_by_mpi(environ=os.environ):
    """True when an MPI launcher (mpiexec, srun) started this process."""
    return any(v in environ for v in LAUNCHER_VARS)


def import_mpi():
    """mpi4py's MPI module (this initialises MPI), or an error that says how to install it."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError(f"this process was started by an MPI launcher but mpi4py is "
                           f"missing ({exc}); {MPI_FIX}") from None
    return MPI


def init_from_env(device=None):
    """A :class:`Comm` for this process when an MPI launcher started it, else None.

    ``mpiexec -n 1`` gives a Comm of size 1 (it exercises the same code path as N ranks);
    ``python train.py`` gives None. ``device`` ('cpu' or 'cuda') may be chosen now or later
    with ``Comm.init_device`` (the Trainer does it once it has parsed --device).
    """
    if not launched_by_mpi():
        return None
    MPI = import_mpi()
    return Comm(MPI, MPI.COMM_WORLD, device=device)


@contextlib.contextmanager
def abort_on_error(comm):
    """Turn a failure on one rank into the end of the whole job.

    A rank that exits while the others wait in a collective would leave them waiting forever
    (MPI_Finalize waits for all ranks), so an exception, or a non-zero ``sys.exit``, prints
    its message and calls MPI_Abort, which makes the launcher stop every rank. A stop the
    ranks agreed on (``comm.agreed_stop``: a signal, after which all save and exit with 128 +
    its number, or a divergence, exit 3) ends normally on every rank. No-op without a Comm.
    """
    if comm is None:
        yield
        return
    try:
        yield
    except SystemExit as exc:
        code = exc.code
        if code is None or code == 0 or getattr(comm, "agreed_stop", False):
            raise
        if not isinstance(code, int):
            print(code, file=sys.stderr, flush=True)
            code = 1
        comm.abort(code)
    except BaseException:
        print(f"rank {comm.rank} of {comm.size} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        comm.abort(1)


# ----------------------------------------------------------------------------- flat buffers

def grad_buffer(params, loss_sum, n_tok, out=None):
    """Everything one update sums over ranks, as one flat buffer in the gradients' dtype:

        [grad of params[0], ..., grad of params[P-1] (raveled, zeros for None) |
         P flags (1 where the parameter has a gradient) | loss_sum | n_tok]

    The layout depends only on the parameters' shapes, so it is the same on every rank,
    including a rank whose shard was empty (all gradients None). The flags let the update
    skip a parameter that no rank gave a gradient, as a single process would. n_tok is
    exact in float32 while the global count stays below 2^24 (16.7M target tokens per
    update); loss_sum is only logged. ``out``: a buffer of the right size to fill instead of
    allocating one.
    """
    xp, dtype = params[0].xp, params[0].dtype
    n = sum(p.size for p in params)
    buf = xp.empty(n + len(params) + 2, dtype=dtype) if out is None else out
    tail = np.zeros(len(params) + 2, dtype=dtype)  # built on the host, copied over once
    offset = 0
    for i, p in enumerate(params):
        if p.grad is not None:
            buf[offset:offset + p.size] = p.grad.ravel()
            tail[i] = 1
        else:
            buf[offset:offset + p.size] = 0
        offset += p.size
    tail[-2], tail[-1] = loss_sum, n_tok
    buf[n:] = xp.asarray(tail)
    return buf


def apply_grad_buffer(buf, params):
    """Inverse of :func:`grad_buffer` after the sum: sets each ``p.grad`` (a view of ``buf``,
    or None where no rank had a gradient) -> (loss_sum, n_tok) over all ranks."""
    n = sum(p.size for p in params)
    tail = backend.to_numpy(buf[n:])  # one device -> host copy: flags, loss_sum, n_tok
    offset = 0
    for i, p in enumerate(params):
        p.grad = buf[offset:offset + p.size].reshape(p.shape) if tail[i] > 0 else None
        offset += p.size
    return float(tail[-2]), int(round(float(tail[-1])))


def buckets(n, itemsize, bucket_bytes=BUCKET_BYTES):
    """[(start, end)] slices of an n-element buffer, each at most ``bucket_bytes``."""
    step = max(1, bucket_bytes // itemsize)
    return [(s, min(s + step, n)) for s in range(0, n, step)]


# ----------------------------------------------------------------------------- the communicator

class Comm:
    """This process's place among the ranks, and the collectives training needs.

    rank, size, local_rank (rank among the processes on this node), device ('cpu' or 'cuda');
    ``allreduce_s`` adds up the seconds spent in ``allreduce_grads`` (this rank's clock).
    """

    def __init__(self, MPI, mpi_comm, device=None, bucket_bytes=BUCKET_BYTES):
        self.MPI, self.mpi = MPI, mpi_comm
        self.rank, self.size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.local_rank = self._local_rank()
        self.bucket_bytes = bucket_bytes
        self.device, self.nccl = None, None
        self.allreduce_s = 0.0
        self.agreed_stop = False  # set when every rank stops at once (abort_on_error)
        self._buf = None  # the flat gradient buffer, reused every update
        if device is not None:
            self.init_device(device)

    def _local_rank(self):
        for v in LOCAL_RANK_VARS:
            if v in os.environ:
                return int(os.environ[v])
        # any MPI-3 launcher: the rank among the processes that share this node's memory
        return self.mpi.Split_type(self.MPI.COMM_TYPE_SHARED).Get_rank()

    def __repr__(self):
        return f"Comm(rank {self.rank} of {self.size}, local rank {self.local_rank}, {self.device})"

    # ---- set-up --------------------------------------------------------------------------
    def init_device(self, device):
        """Choose this rank's device -> 'cpu' or 'cuda'. For 'cuda': GPU number local_rank
        (or the only GPU this process sees, when the launcher gave each rank its own
        CUDA_VISIBLE_DEVICES) and an NCCL communicator over all ranks."""
        device = (device or "cpu").lower()
        if device == "gpu":
            device = "cuda"
        if self.device is not None:
            if device != self.device:
                raise ValueError(f"{self}: already set up for {self.device}, not {device}")
            return self.device
        if device == "cuda":
            self._init_nccl()
        elif device != "cpu":
            raise ValueError(f"unknown device {device!r}: use 'cpu' or 'cuda'")
        self.device = device
        return device

    def _init_nccl(self):
        cupy = backend.get_xp("cuda")  # raises, with the fix, without CuPy or a GPU
        from cupy.cuda import nccl  # CuPy's NCCL bindings; needs the NCCL library
        if not getattr(nccl, "available", True):
            raise RuntimeError("CuPy cannot load NCCL, which multi-GPU training uses; install "
                               "it with `pip install nvidia-nccl-cu12` (or -cu13, for CuPy "
                               ">= 14) or `python -m cupyx.tools.install_library --cuda 12.x "
                               "--library nccl` (CuPy 13); `python -m minitransformer.doctor` "
                               "checks")
        n_gpus = cupy.cuda.runtime.getDeviceCount()
        gpu = self.local_rank if n_gpus > 1 else 0
        if gpu >= n_gpus:
            raise RuntimeError(f"rank {self.rank} is process {self.local_rank} on its node, "
                               f"which has {n_gpus} visible GPUs: start one process per GPU "
                               f"(e.g. mpiexec -n {n_gpus} on one node)")
        cupy.cuda.Device(gpu).use()
        self.gpu, self.cupy, self._nccl_lib = gpu, cupy, nccl
        uid = nccl.get_unique_id() if self.rank == 0 else None
        uid = self.mpi.bcast(uid, root=0)
        self.nccl = nccl.NcclCommunicator(self.size, uid, self.rank)

    # ---- collectives ---------------------------------------------------------------------
    def barrier(self):
        self.mpi.Barrier()

    def abort(self, code=1):
        self.mpi.Abort(code)

    def shard(self, batch):
        """This rank's part of a batch (lists of pairs), balanced by target tokens. A batch of
        fewer pairs than ranks leaves some ranks an empty list."""
        return split_batch(batch, self.size)[self.rank]

    def dropout_seed(self, seed, update):
        """The dropout generator's seed for this rank at this update: independent streams per
        rank, reproduced exactly by a resumed run without saving any generator state."""
        return int(np.random.SeedSequence([seed, self.rank, update]).generate_state(1)[0])

    def _sum(self, buf):
        """Sum ``buf`` over all ranks, in place, bucket by bucket."""
        for s, e in buckets(buf.size, buf.itemsize, self.bucket_bytes):
            chunk = buf[s:e]
            if self.nccl is None:
                self.mpi.Allreduce(self.MPI.IN_PLACE, chunk, op=self.MPI.SUM)
            else:
                nccl = self._nccl_lib
                self.nccl.allReduce(chunk.data.ptr, chunk.data.ptr, chunk.size,
                                    self._nccl_dtype(chunk.dtype), nccl.NCCL_SUM,
                                    self.cupy.cuda.get_current_stream().ptr)

    def _nccl_dtype(self, dtype):
        nccl = self._nccl_lib
        return {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float64): nccl.NCCL_FLOAT64,
                np.dtype(np.float16): nccl.NCCL_FLOAT16}[np.dtype(dtype)]

    def _sync(self):
        if self.nccl is not None:
            self.cupy.cuda.get_current_stream().synchronize()

    def allreduce_grads(self, params, loss_sum, n_tok, flat_grad=None):
        """Sum every parameter's gradient, the loss and the target-token count over all ranks
        -> (global loss_sum, global n_tok).

        Afterwards every rank holds the same summed gradients; the caller divides by n_tok.
        Without ``flat_grad`` everything goes into one flat buffer of this Comm's (see
        ``grad_buffer``), summed in one all-reduce; each ``p.grad`` then becomes a view of
        it (None for a parameter that no rank gave a gradient) that the next call
        overwrites (the Trainer drops them after the optimizer step).
        ``flat_grad``: a buffer of which every ``p.grad`` is already a view (the optimizer's,
        ``Adam.flat_grad()``): it is summed where it is, with no copy, and the gradients
        stay views of it, so the optimizer can go on updating all parameters at once; the
        loss and the count follow in a two-number all-reduce. There no gradient is None:
        a parameter that no rank gave one has a zero gradient, and flat Adam updates it
        (from its momentum), as it does in one process."""
        self._sync()  # on a GPU, let backward finish so that the timer sees only the sum
        t0 = time.perf_counter()
        xp, dtype = params[0].xp, params[0].dtype
        if flat_grad is not None:
            self._sum(flat_grad)
            tail = xp.asarray(np.array([loss_sum, n_tok], dtype=flat_grad.dtype))
            self._sum(tail)
            loss_sum, n_tok = backend.to_numpy(tail).tolist()  # waits for both sums
            self.allreduce_s += time.perf_counter() - t0
            return float(loss_sum), int(round(n_tok))
        # One buffer for the whole run: no new pages to map and for MPI to register at every
        # update (on the CPU, 190 kB summed in ~0.1 ms when reused, ~2 ms when fresh).
        size = sum(p.size for p in params) + len(params) + 2
        if self._buf is None or self._buf.size != size or self._buf.dtype != dtype:
            self._buf = xp.empty(size, dtype=dtype)
        buf = grad_buffer(params, loss_sum, n_tok, out=self._buf)
        self._sum(buf)
        loss_sum, n_tok = apply_grad_buffer(buf, params)  # reads the tail: waits for the sum
        self.allreduce_s += time.perf_counter() - t0
        return loss_sum, n_tok

    def broadcast_params(self, params):
        """Copy rank 0's parameter values to every rank (in place), in one flat buffer."""
        xp, dtype = params[0].xp, params[0].dtype
        buf = xp.concatenate([p.data.ravel() for p in params]).astype(dtype, copy=False)
        for s, e in buckets(buf.size, buf.itemsize, self.bucket_bytes):
            chunk = buf[s:e]
            if self.nccl is None:
                self.mpi.Bcast(chunk, root=0)
            else:
                self.nccl.bcast(chunk.data.ptr, chunk.size, self._nccl_dtype(chunk.dtype), 0,
                                self.cupy.cuda.get_current_stream().ptr)
        offset = 0
        for p in params:
            p.data[...] = buf[offset:offset + p.size].reshape(p.shape)
            offset += p.size
        self._sync()

    def lowest_rank_where(self, flag):
        """The lowest rank whose ``flag`` is true, or None (one all-reduce): a decision every
        rank takes alike from what some ranks saw."""
        mine = np.array([self.size - self.rank if flag else 0], dtype=np.float64)
        self.mpi.Allreduce(self.MPI.IN_PLACE, mine, op=self.MPI.MAX)
        return self.size - int(mine[0]) if mine[0] else None

    def same_as_rank0(self, value):
        """Rank 0's ``value`` (any picklable object), on every rank."""
        return self.mpi.bcast(value, root=0)

    def differences_from_rank0(self, options):
        """The first rank whose ``options`` ({name: value}) differ from rank 0's -> (that
        rank, [(name, its value, rank 0's value)]), on every rank alike; None when every
        rank has rank 0's. Ranks started with other flags would part at the first stopping
        rule or collective that reads one, and wait for each other forever."""
        ref = self.same_as_rank0(options)
        diff = [(k, options.get(k), ref.get(k)) for k in sorted(set(ref) | set(options))
                if options.get(k) != ref.get(k)]
        rank = self.lowest_rank_where(bool(diff))
        return None if rank is None else (rank, self.mpi.bcast(diff, root=rank))

    def agree_min(self, value):
        """The smallest of every rank's ``value`` (a number), on every rank."""
        mine = np.array([value], dtype=np.float64)
        self.mpi.Allreduce(self.MPI.IN_PLACE, mine, op=self.MPI.MIN)
        return type(value)(mine[0])

    def local_size(self):
        """The ranks on this machine (sharing its memory)."""
        local = self.mpi.Split_type(self.MPI.COMM_TYPE_SHARED)
        try:
            return local.Get_size()
        finally:
            local.Free()  # (a communicator holds MPI resources until freed)

    def agree_to_stop(self, elapsed, signum):
        """One decision for all ranks, taken before each update: -> (rank 0's ``elapsed``
        seconds, the largest signal number any rank received, or None).

        A rank that stopped on its own clock or its own SIGTERM would leave the others
        waiting in the next all-reduce; with this every rank stops after the same update."""
        mine = np.array([elapsed if self.rank == 0 else 0.0, signum or 0], dtype=np.float64)
        self.mpi.Allreduce(self.MPI.IN_PLACE, mine, op=self.MPI.MAX)
        return float(mine[0]), (int(mine[1]) or None)
