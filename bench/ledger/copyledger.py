"""The copy ledger: what one process copies in host memory, serialises and sends, written to
a file of its own so that a benchmark can add up every process of a weight push (see
bench/weight_sync.py, which reads and sums these files).

Installed by this folder's sitecustomize.py when RLX_COPY_LEDGER names a folder and the folder
is first on PYTHONPATH: every Python process started with that environment installs it at
start-up (the bench's driver, Ray's workers and helper processes, vLLM's engine core and its
tensor-parallel workers, forked or spawned). It costs nothing until torch, msgspec, zmq, Ray
or vLLM are imported, and then a Python call per torch operator.

What it counts (each event: time, kind, bytes, a detail), by mechanism:

- torch copies (kind "copy"): a TorchDispatchMode, pushed on every thread (at torch's import,
  in every thread started after it, and on the first pickle/zmq call of a thread Python did
  not start), counts the bytes each copy-like operator writes on the host: copy_, _to_copy,
  clone (what .contiguous() and .to() become), cat, stack, padding, the *_copy operators,
  index_select, pin_memory, FSDP2's copy-in/copy-out. A mode rather than patching Tensor
  methods because it sees the operators whatever calls them (C++ included: the copy_ inside
  vLLM's weight loaders, the padding inside DTensor's gather), by what they do rather than by
  the name of a Python method, and it sees the collectives too. Copies whose Python stack
  passes through vllm/model_executor/ are marked "dest": vLLM's load_weights and its layerwise
  reload writing the new values into the engine's parameters, which every design must do.
  A DTensor result is counted by its local shard (what this rank holds).
- collectives ("coll-recv", "coll-sent"): the c10d and functional-collective operators as
  the same mode sees them (dist.* calls, ProcessGroup methods called directly, DTensor's and
  FSDP's gathers); backends called directly (ProcessGroupGloo(...).broadcast, which no
  operator dispatches) and vLLM's PyNcclCommunicator (ctypes NCCL) by patching their
  methods. Counted as the bytes that arrive from and leave for other ranks (a ring's
  logical traffic: all_gather receives (w-1)/w of its output and sends its input w-1 times;
  a broadcast's root sends the tensor w-1 times, the others receive it once). These are the
  wire, not host copies.
- serialisation: pickle streams written ("pickle-out": pickle.dumps, every Pickler.dump,
  cloudpickle's and Ray's included) and read ("pickle-in": pickle.loads, in-band bytes);
  buffers handed out of band ("pickle-oob", not copied by pickle); torch's tensor reduction,
  which torch.saves the storage into a bytes object ("tensor-to-bytes") and torch.loads it
  back ("bytes-to-tensor"); msgspec msgpack encoding ("msgpack-out": the in-band buffer,
  into which an Ext payload such as a pickled callable is copied).
- vLLM's shared-memory ring (vLLM's MessageQueue, executor -> workers): "shm-write" when a
  message goes through the ring, "shm-read" for the out-of-band buffers a reader copies out.
- Ray: "ray-write" for every object Ray serialises (the bytes copied into the object store,
  or into an inline reply for small ones), "ray-read" for objects it deserialises (mapped
  from the store: out-of-band numpy buffers are not copied, so this is not a host copy).
- ZMQ: "zmq-send", "zmq-recv", the bytes of the frames handed to and taken from sockets:
  the wire between vLLM's processes.

What it cannot see: copies made inside C code that calls no Python and no torch operator.
libzmq's own copies (copy=True, small frames) and the kernel's two copies of every socket
byte (ZMQ over ipc/tcp, gloo over tcp, Ray's object transfers between raylets); gloo's
copies of a rank's own chunk into the output; Ray's plasma writes and its node-to-node
transfers themselves (the write is counted at serialisation, a transfer is not seen at
all); bytes(), bytearray(), memoryview slices and BytesIO.getvalue() copies in Python code
other than those named above; numpy copies (tobytes, astype); copies inside vLLM's C++ ops
(its CPU build's weight repacking); redistributions DTensor does inside an operator (its
explicit gathers, full_tensor() and redistribute(), are seen). Device copies (H2D, D2H)
would be counted apart ("h2d", "d2h") on a GPU machine; on CPU there are none.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time

ENV = "RLX_COPY_LEDGER"
BIG = 64 * 1024  # events at least this large are written one by one, with their call site
SLOT = 0.1  # seconds: smaller events are summed per kind over slots of this length

_tls = threading.local()
_lock = threading.Lock()
_state: dict = {}

COPY_OPS = {
    "copy_",
    "_to_copy",
    "clone",
    "cat",
    "stack",
    "constant_pad_nd",
    "narrow_copy",
    "split_with_sizes_copy",
    "slice_copy",
    "select_copy",
    "view_copy",
    "detach_copy",
    "alias_copy",
    "expand_copy",
    "permute_copy",
    "transpose_copy",
    "t_copy",
    "unfold_copy",
    "as_strided_copy",
    "_reshape_copy",
    "repeat",
    "index_select",
    "lift_fresh_copy",
    "_foreach_copy_",
    "_pin_memory",
    "all_gather_copy_in",  # FSDP2 (namespace fsdp)
    "chunk_cat",
}
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
SKIP_COLLECTIVE = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"}
SITE_ROOTS = ("/rlx/", "/vllm/", "/ray/", "/torch/distributed/", "/bench/")


# --------------------------------------------------------------------------- recording


def record(kind: str, nbytes: int, detail: str = "", site: bool = True) -> None:
    """One event of this process. Large ones are kept with their call site; small ones are
    summed per kind and time slot (their count as detail)."""
    if not _state or nbytes <= 0:
        return
    now = time.time()
    if nbytes >= BIG:
        where, dest = _call_site() if site else ("", False)
        if dest and kind == "copy":
            kind = "dest"
        line = f"{now:.6f}\t{kind}\t{nbytes}\t{detail}\t{where}\n"
        with _lock:
            _state["lines"].append(line)
        return
    key = (int(now / SLOT), kind)
    with _lock:
        small = _state["small"]
        total, count = small.get(key, (0, 0))
        small[key] = (total + nbytes, count + 1)


def _call_site() -> tuple[str, bool]:
    """(the innermost frame of interest, whether vLLM's model code is on the stack)."""
    frame = sys._getframe(2)
    site = ""
    fallback = ""
    dest = False
    me = __file__
    depth = 0
    while frame is not None and depth < 80:
        name = frame.f_code.co_filename
        if name != me:
            if not fallback and "/torch/" not in name:
                fallback = f"{_short(name)}:{frame.f_code.co_name}"
            if not site and any(root in name for root in SITE_ROOTS):
                site = f"{_short(name)}:{frame.f_code.co_name}"
            if "/vllm/model_executor/" in name:
                dest = True
        frame = frame.f_back
        depth += 1
    return site or fallback, dest


def _short(path: str) -> str:
    for root in ("/site-packages/", "/work/", "/tmp/"):
        if root in path:
            path = path.split(root, 1)[1]
    return path


def _flush() -> None:
    if not _state:
        return
    with _lock:
        lines, _state["lines"] = _state["lines"], []
        small, _state["small"] = _state["small"], {}
    for (slot, kind), (total, count) in small.items():
        lines.append(f"{slot * SLOT:.6f}\t{kind}\t{total}\tsmall x{count}\t\n")
    meta = _meta()
    if meta != _state.get("meta"):
        _state["meta"] = meta
        lines.append("#" + json.dumps(meta) + "\n")
    if lines:
        handle = _state["file"]
        handle.write("".join(lines))
        handle.flush()


def _meta() -> dict:
    """Who this process is, as far as it knows now (its title changes as Ray and vLLM name
    it; its rank and Ray node once those exist)."""
    meta = {"pid": os.getpid(), "ppid": os.getppid()}
    try:
        with open("/proc/self/cmdline", "rb") as handle:
            meta["title"] = handle.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        pass
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            meta["rank"] = dist.get_rank()
            meta["world"] = dist.get_world_size()
    except Exception:
        pass
    rlx = sys.modules.get("rlx")
    if rlx is not None and getattr(rlx, "__file__", None):
        meta["rlx"] = os.path.dirname(os.path.abspath(rlx.__file__))
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            meta["node"] = ray.get_runtime_context().get_node_id()
    except Exception:
        pass
    return meta


def _flusher() -> None:
    while True:
        time.sleep(0.2)
        with contextlib.suppress(Exception):
            _flush()


def _open(folder: str) -> None:
    _state.clear()
    name = os.path.join(folder, f"{os.getpid()}-{time.time_ns()}.ledger")
    handle = open(name, "a", buffering=1 << 16)  # noqa: SIM115 (open for the process's life)
    _state.update(lines=[], small={}, file=handle, meta=None)
    thread = threading.Thread(target=_flusher, name="copy-ledger", daemon=True)
    thread.start()


# --------------------------------------------------------------------------- torch


def _is_plain(tensor) -> bool:
    import torch

    return type(tensor) in (torch.Tensor, torch.nn.Parameter)


def _local(tensor):
    """The tensor whose bytes this process holds: a DTensor's local shard; None for fake,
    meta or other subclass tensors."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        return None
    if type(tensor).__name__ == "DTensor":
        tensor = tensor._local_tensor
    if not _is_plain(tensor) or tensor.device.type == "meta":
        return None
    return tensor


def _tensors(value):
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _nbytes(value) -> int:
    total = 0
    for tensor in _tensors(value):
        local = _local(tensor)
        if local is not None:
            total += local.numel() * local.element_size()
    return total


def _device(value) -> str | None:
    for tensor in _tensors(value):
        local = _local(tensor)
        if local is not None:
            return local.device.type
    return None


def _count_copy(name: str, args, kwargs, out) -> None:
    target = args[0] if name in ("copy_", "_foreach_copy_") and args else out
    nbytes = _nbytes(target)
    if not nbytes:
        return
    dst = _device(target)
    if name == "copy_" and len(args) > 1:
        src = _device(args[1])
    else:
        src = _device(args[0] if args else None)
    if dst == "cpu" and src in (None, "cpu"):
        record("copy", nbytes, name)
    elif dst == "cpu":
        record("d2h", nbytes, name)
    elif src == "cpu":
        record("h2d", nbytes, name)


def _group(args) -> tuple[int, int] | None:
    """(size, this process's rank) of the process group among a c10d operator's args."""
    import torch

    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                arg = torch._C._distributed_c10d.ProcessGroup.unbox(arg)
            except Exception:
                continue
        if type(arg).__name__ == "ProcessGroup":
            try:
                return arg.size(), arg.rank()
            except Exception:
                return None
    return None


def _functional_group(name_arg) -> tuple[int, int] | None:
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(name_arg)
        return group.size(), group.rank()
    except Exception:
        return None


def _count_collective(namespace: str, name: str, args, out) -> None:
    """The bytes a collective brings in from other ranks and sends out to them."""
    base = name.rstrip("_")
    recv = sent = 0
    size = None
    if namespace == "c10d":
        group = _group(args)
        if group is None:
            return
        size, rank = group
        if base in ("_allgather_base", "allgather", "allgather_into_tensor_coalesced"):
            outputs, inputs = _nbytes(args[0]), _nbytes(args[1])
            recv, sent = outputs - inputs, inputs * (size - 1)
        elif base == "broadcast":
            nbytes, root = _nbytes(args[0]), args[2]
            if rank == root:
                sent = nbytes * (size - 1)
            else:
                recv = nbytes
        elif base in ("_reduce_scatter_base", "reduce_scatter", "reduce_scatter_tensor_coalesced"):
            nbytes = _nbytes(args[0])
            recv = sent = nbytes * (size - 1)
        elif base in ("allreduce", "allreduce_coalesced"):
            nbytes = _nbytes(args[0])
            recv = sent = 2 * nbytes * (size - 1) // max(size, 1)
        elif base == "send":
            sent = _nbytes(args[0])
        elif base in ("recv", "recv_any_source"):
            recv = _nbytes(args[0])
        elif base == "gather":
            outputs, inputs = _nbytes(args[0]), _nbytes(args[1])
            root = args[3] if len(args) > 3 and isinstance(args[3], int) else 0
            if rank == root:
                recv = outputs - inputs
            else:
                sent = inputs
        elif base == "scatter":
            outputs, inputs = _nbytes(args[0]), _nbytes(args[1])
            root = args[3] if len(args) > 3 and isinstance(args[3], int) else 0
            if rank == root:
                sent = inputs - outputs
            else:
                recv = outputs
        else:
            recv = sent = _nbytes(args)
    else:
        if base in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
            nbytes, size = _nbytes(args[0]), int(args[1])
            recv = sent = nbytes * (size - 1)
        elif base == "broadcast":
            group = _functional_group(args[2])
            if group is None:
                return
            size, rank = group
            nbytes = _nbytes(args[0])
            if rank == args[1]:
                sent = nbytes * (size - 1)
            else:
                recv = nbytes
        elif base in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
            nbytes, size = _nbytes(out), int(args[2])
            recv = sent = nbytes * (size - 1)
        elif base in ("all_reduce", "all_reduce_coalesced"):
            group = _functional_group(args[2])
            size = group[0] if group else 2
            nbytes = _nbytes(args[0])
            recv = sent = 2 * nbytes * (size - 1) // max(size, 1)
        else:
            recv = sent = _nbytes(args)
    detail = f"{base} w={size}"
    record("coll-recv", recv, detail)
    record("coll-sent", sent, detail)


def _wire(op: str, size: int, rank: int, args: tuple, root: int | None = None) -> None:
    """Bytes in and out of a collective called on a backend (or communicator) directly."""
    recv = sent = 0
    if op in ("broadcast",):
        nbytes = _nbytes(args[0])
        root = 0 if root is None else root
        if rank == root:
            sent = nbytes * (size - 1)
        else:
            recv = nbytes
    elif op in ("allgather", "_allgather_base", "all_gather", "allgather_into_tensor_coalesced"):
        outputs, inputs = _nbytes(args[0]), _nbytes(args[1])
        recv, sent = outputs - inputs, inputs * (size - 1)
    elif op == "send":
        sent = _nbytes(args[0])
    elif op == "recv":
        recv = _nbytes(args[0])
    elif op in ("allreduce", "all_reduce"):
        nbytes = _nbytes(args[0])
        recv = sent = 2 * nbytes * (size - 1) // max(size, 1)
    else:
        recv = sent = _nbytes(args)
    record("coll-recv", recv, f"{op} w={size} direct")
    record("coll-sent", sent, f"{op} w={size} direct")


def _root_of(args: tuple, kwargs: dict) -> int | None:
    for value in list(args[1:]) + list(kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        root = getattr(value, "rootRank", None)
        if isinstance(root, int):
            return root
    return None


BACKEND_METHODS = (
    "broadcast",
    "allgather",
    "_allgather_base",
    "allgather_into_tensor_coalesced",
    "allreduce",
    "send",
    "recv",
    "reduce_scatter",
    "_reduce_scatter_base",
    "gather",
    "scatter",
)


def _install_backends(torch) -> None:
    """Collectives called on a c10d backend object directly (ProcessGroupGloo(...).broadcast)
    bypass the dispatcher the mode watches; ProcessGroup's own methods do not (no double
    count: the ProcessGroup calls its backend from C++)."""
    try:
        import torch.distributed as dist
    except Exception:
        return
    for name in ("ProcessGroupGloo", "ProcessGroupNCCL", "ProcessGroupMPI"):
        cls = getattr(dist, name, None)
        if cls is None:
            continue
        for method in BACKEND_METHODS:
            original = getattr(cls, method, None)
            if original is None:
                continue

            def counted(self, *args, _original=original, _op=method, **kwargs):
                out = _original(self, *args, **kwargs)
                with contextlib.suppress(Exception):
                    root = _root_of(args, kwargs) if _op == "broadcast" else None
                    _wire(_op, self.size(), self.rank(), args, root)
                return out

            with contextlib.suppress(Exception):
                setattr(cls, method, counted)


def _install_pynccl(module) -> None:
    """vLLM's ctypes NCCL communicator (GPU weight groups) calls no torch operator."""
    cls = getattr(module, "PyNcclCommunicator", None)
    if cls is None:
        return
    for method, op in (
        ("broadcast", "broadcast"),
        ("send", "send"),
        ("recv", "recv"),
        ("all_gather", "all_gather"),
        ("all_reduce", "all_reduce"),
    ):
        original = getattr(cls, method, None)
        if original is None:
            continue

        def counted(self, *args, _original=original, _op=op, **kwargs):
            out = _original(self, *args, **kwargs)
            with contextlib.suppress(Exception):
                root = kwargs.get("src", args[1] if len(args) > 1 else 0)
                if _op == "all_gather":
                    args = (args[0], args[1])
                _wire(_op, self.world_size, self.rank, args, root)
            return out

        setattr(cls, method, counted)


def _make_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class CopyLedgerMode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            try:
                packet = func._overloadpacket.__name__
                namespace = func.namespace
                if packet in COPY_OPS:
                    _count_copy(packet, args, kwargs, out)
                elif namespace in COLLECTIVE_NAMESPACES and packet not in SKIP_COLLECTIVE:
                    _count_collective(namespace, packet, args, out)
            except Exception:
                pass
            return out

    return CopyLedgerMode


def ensure_mode() -> None:
    """Push the ledger's dispatch mode on this thread, once, if torch is ready and no other
    mode is active (pushing under another mode would unbalance its stack)."""
    if getattr(_tls, "mode", False) or "mode" not in _state:
        return
    try:
        import torch

        if torch._C._len_torch_dispatch_stack() != 0:
            return
        from torch.utils._python_dispatch import _push_mode

        _push_mode(_state["mode"]())
        _tls.mode = True
    except Exception:
        pass


def _install_torch(torch) -> None:
    storage = torch.storage

    def wrap_reduce(cls):
        original = cls.__dict__["__reduce__"]

        def __reduce__(self):
            out = original(self)
            with contextlib.suppress(Exception):
                record("tensor-to-bytes", len(out[1][0]), "torch storage __reduce__")
            return out

        cls.__reduce__ = __reduce__

    wrap_reduce(storage._StorageBase)
    wrap_reduce(storage.TypedStorage)
    original_load = storage._load_from_bytes

    def _load_from_bytes(b):
        record("bytes-to-tensor", len(b), "torch.storage._load_from_bytes")
        return original_load(b)

    _load_from_bytes.__module__ = original_load.__module__
    _load_from_bytes.__qualname__ = original_load.__qualname__
    storage._load_from_bytes = _load_from_bytes
    _state["mode"] = _make_mode()
    ensure_mode()
    _install_backends(torch)


# --------------------------------------------------------------------------- pickle


def _size(data) -> int:
    try:
        return memoryview(data).nbytes
    except TypeError:
        try:
            return len(data)
        except TypeError:
            return 0


def _out_of_band(callback):
    if callback is None:
        return None

    def buffer_callback(buffer):
        kept_in_band = callback(buffer)
        if not kept_in_band:
            try:
                nbytes = buffer.raw().nbytes
                record("pickle-oob", nbytes, "out of band", site=False)
                _scope_add("oob", nbytes)
            except Exception:
                pass
        return kept_in_band

    return buffer_callback


def _install_pickle() -> None:
    import _pickle
    import pickle

    original_dumps, original_loads = pickle.dumps, pickle.loads

    def dumps(obj, protocol=None, *, fix_imports=True, buffer_callback=None):
        ensure_mode()
        out = original_dumps(
            obj, protocol, fix_imports=fix_imports, buffer_callback=_out_of_band(buffer_callback)
        )
        record("pickle-out", len(out), "pickle.dumps")
        return out

    def loads(data, /, *, fix_imports=True, encoding="ASCII", errors="strict", buffers=()):
        ensure_mode()
        record("pickle-in", _size(data), "pickle.loads")
        if buffers:
            buffers = list(buffers)
            _scope_add("loads_oob", sum(_size(b) for b in buffers))
        return original_loads(
            data, fix_imports=fix_imports, encoding=encoding, errors=errors, buffers=buffers
        )

    class Pickler(_pickle.Pickler):
        def __init__(self, file, protocol=None, *args, **kwargs):
            if len(args) >= 2:
                args = (args[0], _out_of_band(args[1]), *args[2:])
            elif "buffer_callback" in kwargs:
                kwargs["buffer_callback"] = _out_of_band(kwargs["buffer_callback"])
            super().__init__(file, protocol, *args, **kwargs)
            self._ledger_file = file

        def dump(self, obj):
            ensure_mode()
            try:
                start = self._ledger_file.tell()
            except Exception:
                start = None
            super().dump(obj)
            if start is not None:
                try:
                    written = self._ledger_file.tell() - start
                except Exception:
                    written = 0
                record("pickle-out", written, type(self).__module__ + "." + type(self).__name__)
                _scope_add("pickled", written)

    # Pickled by reference (a spawned process's state holds them) as pickle.dumps etc.
    for wrapper, name in ((dumps, "dumps"), (loads, "loads"), (Pickler, "Pickler")):
        wrapper.__module__, wrapper.__qualname__, wrapper.__name__ = "pickle", name, name
    pickle.dumps, pickle.loads, pickle.Pickler = dumps, loads, Pickler


# --------------------------------------------------------------------------- scopes


def _scope_add(key: str, nbytes: int) -> None:
    scope = getattr(_tls, "scope", None)
    if scope is not None:
        scope[key] = scope.get(key, 0) + nbytes


class _Scope:
    def __enter__(self):
        self.outer = getattr(_tls, "scope", None)
        _tls.scope = self.counts = {}
        return self.counts

    def __exit__(self, *exc):
        _tls.scope = self.outer
        if self.outer is not None:
            for key, value in self.counts.items():
                self.outer[key] = self.outer.get(key, 0) + value


# --------------------------------------------------------------------------- msgspec, zmq


def _install_msgspec(module) -> None:
    """module: msgspec.msgpack."""
    original = module.Encoder

    class Encoder:
        """msgspec's encoder, counting the bytes it writes."""

        def __init__(self, *args, **kwargs):
            self._encoder = original(*args, **kwargs)

        def encode(self, obj):
            ensure_mode()
            out = self._encoder.encode(obj)
            record("msgpack-out", len(out), "msgspec.msgpack.Encoder.encode")
            return out

        def encode_into(self, obj, buffer, *args):
            before = len(buffer) if not args else args[0]
            result = self._encoder.encode_into(obj, buffer, *args)
            record("msgpack-out", len(buffer) - max(before, 0), "encode_into")
            return result

        def __getattr__(self, name):
            return getattr(self._encoder, name)

    Encoder.__module__, Encoder.__qualname__ = module.__name__, "Encoder"
    module.Encoder = Encoder


def _install_zmq(zmq) -> None:
    cls = zmq.sugar.socket.Socket
    send, recv = cls.send, cls.recv

    def counted_send(self, data, flags=0, copy=True, track=False, **kwargs):
        ensure_mode()
        nbytes = _size(data.buffer if isinstance(data, zmq.Frame) else data)
        record("zmq-send", nbytes, "copy" if copy else "zero-copy", site=False)
        _scope_add("zmq", nbytes)
        return send(self, data, flags, copy=copy, track=track, **kwargs)

    def counted_recv(self, flags=0, copy=True, track=False):
        ensure_mode()
        out = recv(self, flags, copy=copy, track=track)
        nbytes = _size(out.buffer if isinstance(out, zmq.Frame) else out)
        record("zmq-recv", nbytes, "", site=False)
        _scope_add("zmq", nbytes)
        return out

    cls.send, cls.recv = counted_send, counted_recv


# --------------------------------------------------------------------------- vLLM, Ray


def _install_shm_broadcast(module) -> None:
    queue = module.MessageQueue
    enqueue, dequeue = queue.enqueue, queue.dequeue

    def counted_enqueue(self, obj, timeout=None):
        with _Scope() as counts:
            result = enqueue(self, obj, timeout)
        # Through the ring unless it went out on a socket (overflow, remote readers).
        if getattr(self, "n_local_reader", 0) > 0 and not counts.get("zmq"):
            oob = counts.get("oob", 0)
            record("shm-write", counts.get("pickled", 0) + oob, "MessageQueue.enqueue")
        return result

    def counted_dequeue(self, timeout=None, indefinite=False):
        with _Scope() as counts:
            result = dequeue(self, timeout, indefinite)
        if not counts.get("zmq"):  # from the ring: out-of-band buffers copied out of it
            record("shm-read", counts.get("loads_oob", 0), "MessageQueue.dequeue")
        return result

    queue.enqueue, queue.dequeue = counted_enqueue, counted_dequeue


def _install_ray_serialization(module) -> None:
    context = module.SerializationContext
    serialize, deserialize = context.serialize, context.deserialize_objects

    def counted_serialize(self, value):
        ensure_mode()
        out = serialize(self, value)
        with contextlib.suppress(Exception):
            record("ray-write", int(out.total_bytes), type(value).__name__)
        return out

    def counted_deserialize(self, serialized_ray_objects, *args, **kwargs):
        ensure_mode()
        try:
            total = sum(_size(item[0]) for item in serialized_ray_objects if item[0] is not None)
            record("ray-read", total, "mapped from the store")
        except Exception:
            pass
        return deserialize(self, serialized_ray_objects, *args, **kwargs)

    context.serialize, context.deserialize_objects = counted_serialize, counted_deserialize


# --------------------------------------------------------------------------- imports


_AFTER_IMPORT = {
    "torch": _install_torch,
    "msgspec.msgpack": _install_msgspec,
    "zmq": _install_zmq,
    "vllm.distributed.device_communicators.shm_broadcast": _install_shm_broadcast,
    "ray._private.serialization": _install_ray_serialization,
    "vllm.distributed.device_communicators.pynccl": _install_pynccl,
}


class _AfterImport:
    """A meta-path finder that runs a hook once a watched module has been executed."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _AFTER_IMPORT or getattr(_tls, "finding", False):
            return None
        _tls.finding = True
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
        finally:
            _tls.finding = False
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module
        hook = _AFTER_IMPORT[fullname]

        class Loader:
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                exec_module(module)
                try:
                    hook(module)
                except Exception as exc:
                    print(f"copy ledger: {fullname}: {exc!r}", file=sys.stderr)

            def __getattr__(self, name):
                return getattr(loader, name)

        spec.loader = Loader()
        return spec


def install() -> None:
    folder = os.environ.get(ENV, "")
    if not folder or _state:
        return
    os.makedirs(folder, exist_ok=True)
    _open(folder)
    atexit.register(_flush)
    os.register_at_fork(after_in_child=lambda: _open(folder))
    _install_pickle()
    original_bootstrap = threading.Thread._bootstrap_inner

    def _bootstrap_inner(self):
        ensure_mode()
        original_bootstrap(self)

    threading.Thread._bootstrap_inner = _bootstrap_inner
    for name, hook in _AFTER_IMPORT.items():
        if name in sys.modules:
            hook(sys.modules[name])
    sys.meta_path.insert(0, _AfterImport())


# --------------------------------------------------------------------------- reading


def read(folder: str) -> list[dict]:
    """Every process's ledger: {"meta": last meta, "metas": all, "events": [(t, kind,
    bytes, detail, site)]}."""
    processes = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".ledger"):
            continue
        metas, events = [], []
        with open(os.path.join(folder, name), errors="replace") as handle:
            for line in handle:
                if line.startswith("#"):
                    with contextlib.suppress(ValueError):
                        metas.append(json.loads(line[1:]))
                    continue
                parts = line.rstrip("\n").split("\t")
                if len(parts) < 5:
                    continue
                try:
                    events.append((float(parts[0]), parts[1], int(parts[2]), parts[3], parts[4]))
                except ValueError:
                    continue
        meta: dict = {}
        for item in metas:
            meta.update(item)
        processes.append({"file": name, "meta": meta, "metas": metas, "events": events})
    return processes
