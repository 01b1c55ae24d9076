"""Communication workspace: buffers allocated once, shared between ranks, closed explicitly.

Two ways to build one:
- `CommWorkspace.create(group, ...)`: one rank per process (the real deployment). Buffers are
  shared through CUDA IPC handles exchanged over `group` (gloo or nccl); P2P is checked for
  every pair of GPUs first. Collective: every rank calls it with the same arguments.
- `CommWorkspace.create_local(world_size, ...)`: all ranks in this process on one GPU, one
  stream each, pointers shared directly. For tests and benchmarks: synchronisation between
  streams costs ~1 us, against ~2.4 ms between processes time-slicing one GPU.

Every rank must issue the same sequence of calls (same sizes, same order) on one stream, as
with any collective. A missing peer makes the call fail after `timeout_ms` (see
`check_error`), instead of hanging the GPU.
"""

from __future__ import annotations

import ctypes
import itertools
from typing import Any

import torch

from . import _lib
from .config import (
    CONTROL_OFFSET,
    ELEMENT_BYTES,
    ROW_SPLIT_SIZES,
    VARIANT_NAMES,
    Tuning,
    WorkspaceLayout,
    check_world_size,
    choose_blocks,
    choose_variant,
    fused_variant,
    resolve_tuning,
    row_blocks,
    split_fused,
    twoshot_lamport_fits,
    workspace_layout,
)
from .errors import CommTimeoutError, WorkspaceError

_DTYPE_CODES = {torch.bfloat16: _lib.DTYPE_BF16, torch.float16: _lib.DTYPE_FP16}
_PHASES = {0: "push / reduce-scatter", 1: "all-gather"}

_registry: dict[int, CommWorkspace] = {}
_next_id = itertools.count(1)


def get_workspace(workspace_id: int) -> CommWorkspace:
    """The open workspace with this id (the torch ops receive ids, not objects)."""
    try:
        return _registry[workspace_id]
    except KeyError:
        raise WorkspaceError(f"workspace {workspace_id} is closed or was never created") from None


def _device_of(device: torch.device | int | str | None) -> torch.device:
    if device is None:
        device = torch.cuda.current_device()
    device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device {device} is not a CUDA device")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _max_bytes(max_tokens: int, hidden: int, dtype: torch.dtype) -> int:
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"dtype {dtype} is not supported: bfloat16 or float16")
    if max_tokens <= 0 or hidden <= 0 or hidden % 8:
        raise ValueError(
            f"max_tokens={max_tokens} and hidden={hidden}: both positive, hidden a multiple of 8"
        )
    return max_tokens * hidden * ELEMENT_BYTES


def _resident_blocks(device_index: int) -> int:
    blocks = ctypes.c_int(0)
    _lib.check(
        _lib.lib().sk_max_resident_blocks(device_index, ctypes.byref(blocks)), "occupancy query"
    )
    return blocks.value


def _resident_clusters(device_index: int) -> dict[int, int]:
    """Row-split clusters of each size row_blocks can choose (powers of two) that the GPU
    holds at once (sk_max_active_clusters). A size whose query fails counts as none fitting:
    the row split is an optimisation, and a block per row is always there."""
    lib = _lib.lib()
    clusters: dict[int, int] = {}
    for size in ROW_SPLIT_SIZES:
        n = ctypes.c_int(0)
        failed = lib.sk_max_active_clusters(device_index, size, ctypes.byref(n)) != 0
        clusters[size] = 0 if failed else n.value
    return clusters


def _alloc(device_index: int, layout: WorkspaceLayout) -> int:
    """One rank's buffer: zeroed (flags, call state), one-shot buffers all "not arrived"."""
    ptr = ctypes.c_void_p()
    lib = _lib.lib()
    _lib.check(
        lib.sk_alloc_zeroed(device_index, layout.total_bytes, ctypes.byref(ptr)),
        f"cudaMalloc of {layout.total_bytes} bytes",
    )
    lamport_bytes = layout.push_offset - layout.lamport_offset
    code = lib.sk_fill(
        device_index, ptr.value + layout.lamport_offset, _lib.LAMPORT_EMPTY_BYTE, lamport_bytes
    )
    if code != 0:
        lib.sk_free(device_index, ptr.value)
        _lib.check(code, f"cudaMemset of {lamport_bytes} bytes")
    return ptr.value


def _alloc_error_mirror(device_index: int) -> tuple[int, int]:
    host, dev = ctypes.c_void_p(), ctypes.c_void_p()
    _lib.check(
        _lib.lib().sk_host_alloc_mapped(
            device_index, _lib.CTRL_WORDS * 4, ctypes.byref(host), ctypes.byref(dev)
        ),
        "host-mapped error word",
    )
    return host.value, dev.value


def _pci_bus_id(device_index: int) -> str:
    buf = ctypes.create_string_buffer(64)
    _lib.check(_lib.lib().sk_device_pci_bus_id(device_index, buf, 64), "cudaDeviceGetPCIBusId")
    return buf.value.decode()


class CommWorkspace:
    """One rank's handle on the shared buffers. Build with `create` or `create_local`."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        layout: WorkspaceLayout,
        tuning: Tuning,
        max_tokens: int,
        hidden: int,
        buffers: list[int],
        opened: list[int],
        group: Any | None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.layout = layout
        self.tuning = tuning
        self.max_tokens = max_tokens
        self.hidden = hidden
        self.max_bytes = layout.max_bytes
        self._buffers = buffers
        self._opened = opened  # peer buffers this process mapped through IPC
        self._group = group
        self._host_error, device_error = _alloc_error_mirror(device.index)
        self._params = self._base_params(device_error)
        self.id = next(_next_id)
        _registry[self.id] = self

    # ----------------------------------------------------------------------------- building

    @classmethod
    def create_local(
        cls,
        world_size: int,
        max_tokens: int,
        hidden: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | int | str | None = None,
        *,
        oneshot_max_bytes: int | None = None,
        twoshot_lamport_max_bytes: int | None = None,
        block_bytes: int | None = None,
        max_blocks: int | None = None,
        timeout_ms: int | None = None,
        fused_rows_per_block: int | None = None,
        early_launch: bool | None = None,
    ) -> list[CommWorkspace]:
        """`world_size` ranks in this process on one GPU; returns one workspace per rank.

        Run each rank's calls on its own stream: the kernels spin on their peers, so all
        ranks' kernels must be resident together (max_blocks x world_size <= what the GPU
        holds; the default cap ensures it).
        """
        check_world_size(world_size)
        device = _device_of(device)
        max_bytes = _max_bytes(max_tokens, hidden, dtype)
        _lib.check(_lib.lib().sk_preload(device.index), "kernel preload")
        tuning = resolve_tuning(
            world_size,
            oneshot_max_bytes=oneshot_max_bytes,
            twoshot_lamport_max_bytes=twoshot_lamport_max_bytes,
            block_bytes=block_bytes,
            max_blocks=max_blocks,
            timeout_ms=timeout_ms,
            fused_rows_per_block=fused_rows_per_block,
            early_launch=early_launch,
            resident_blocks=_resident_blocks(device.index),
            resident_clusters=_resident_clusters(device.index),
            ranks_per_gpu=world_size,
        )
        layout = workspace_layout(
            world_size, max_bytes, tuning.oneshot_max_bytes, tuning.twoshot_lamport_max_bytes
        )
        buffers = [_alloc(device.index, layout) for _ in range(world_size)]
        return [
            cls(
                rank=rank,
                world_size=world_size,
                device=device,
                layout=layout,
                tuning=tuning,
                max_tokens=max_tokens,
                hidden=hidden,
                buffers=buffers,
                opened=[],
                group=None,
            )
            for rank in range(world_size)
        ]

    @classmethod
    def create(
        cls,
        group: Any,
        max_tokens: int,
        hidden: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | int | str | None = None,
        *,
        oneshot_max_bytes: int | None = None,
        twoshot_lamport_max_bytes: int | None = None,
        block_bytes: int | None = None,
        max_blocks: int | None = None,
        timeout_ms: int | None = None,
        fused_rows_per_block: int | None = None,
        early_launch: bool | None = None,
    ) -> CommWorkspace:
        """Collective over `group` (a torch.distributed ProcessGroup, gloo or nccl).

        Every rank raises the same WorkspaceError if any rank finds a problem (a rank that
        raised alone would leave the others blocked in the next collective).
        """
        import torch.distributed as dist

        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        check_world_size(world_size)
        device = _device_of(device)
        dev = device.index

        # Stage 1: local facts and settings; all ranks must agree on the settings.
        error, info = None, {}
        try:
            max_bytes = _max_bytes(max_tokens, hidden, dtype)
            _lib.check(_lib.lib().sk_preload(dev), "kernel preload")
            info = {
                "bus_id": _pci_bus_id(dev),
                "resident": _resident_blocks(dev),
                "clusters": _resident_clusters(dev),
            }
        except Exception as exc:  # reported collectively below
            error = f"rank {rank}: {exc}"
        infos = _agree(group, error, info, "gathering device facts")
        bus_ids = [i["bus_id"] for i in infos]
        ranks_per_gpu = max(bus_ids.count(b) for b in bus_ids)
        error, settings = None, None
        try:
            tuning = resolve_tuning(
                world_size,
                oneshot_max_bytes=oneshot_max_bytes,
                twoshot_lamport_max_bytes=twoshot_lamport_max_bytes,
                block_bytes=block_bytes,
                max_blocks=max_blocks,
                timeout_ms=timeout_ms,
                fused_rows_per_block=fused_rows_per_block,
                early_launch=early_launch,
                resident_blocks=min(i["resident"] for i in infos),
                resident_clusters={
                    k: min(i["clusters"][k] for i in infos) for k in infos[0]["clusters"]
                },
                ranks_per_gpu=ranks_per_gpu,
            )
            layout = workspace_layout(
                world_size, max_bytes, tuning.oneshot_max_bytes, tuning.twoshot_lamport_max_bytes
            )
            settings = _shared_settings(max_bytes, tuning, layout)
        except Exception as exc:
            error = f"rank {rank}: {exc}"
        disagreement = _disagreement(_agree(group, error, settings, "checking settings"))
        if disagreement:
            raise WorkspaceError(disagreement)

        # Stage 2: P2P between every pair of distinct GPUs.
        error = _p2p_problems(rank, dev, bus_ids)
        _agree(group, error, None, "checking P2P access")

        # Stage 3: allocate, export, import (the layout all ranks agreed on in stage 1).
        error, handle, own = None, b"", 0
        try:
            own = _alloc(dev, layout)
            buf = ctypes.create_string_buffer(_lib.IPC_HANDLE_BYTES)
            _lib.check(_lib.lib().sk_ipc_get_handle(dev, own, buf), "cudaIpcGetMemHandle")
            handle = buf.raw
        except Exception as exc:
            error = f"rank {rank}: {exc}"
        handles = _agree(group, error, handle, "allocating and exporting buffers")
        buffers, opened, error = [0] * world_size, [], None
        buffers[rank] = own
        for peer in range(world_size):
            if peer == rank:
                continue
            ptr = ctypes.c_void_p()
            code = _lib.lib().sk_ipc_open_handle(dev, handles[peer], ctypes.byref(ptr))
            if code != 0:
                message = _lib.lib().sk_error_string(code).decode()
                error = (
                    f"rank {rank} cannot map rank {peer}'s buffer: CUDA error {code} ({message})"
                )
                break
            buffers[peer] = ptr.value
            opened.append(ptr.value)
        try:
            _agree(group, error, None, "opening IPC handles")
        except WorkspaceError:
            for ptr in opened:
                _lib.lib().sk_ipc_close_handle(dev, ptr)
            if own:
                _lib.lib().sk_free(dev, own)
            raise
        return cls(
            rank=rank,
            world_size=world_size,
            device=device,
            layout=layout,
            tuning=tuning,
            max_tokens=max_tokens,
            hidden=hidden,
            buffers=buffers,
            opened=opened,
            group=group,
        )

    def close(self) -> None:
        """Releases the buffers. Collective for `create` workspaces; for `create_local` ones,
        close every rank's workspace together (peers point into each other's buffers)."""
        if self.id not in _registry:
            return
        del _registry[self.id]
        torch.cuda.synchronize(self.device)
        lib, dev = _lib.lib(), self.device.index
        if self._group is not None:
            import torch.distributed as dist

            dist.barrier(group=self._group)  # no rank still reads or writes a peer
            for ptr in self._opened:
                _lib.check(lib.sk_ipc_close_handle(dev, ptr), "cudaIpcCloseMemHandle")
            dist.barrier(group=self._group)  # no rank still maps our buffer
        _lib.check(lib.sk_free(dev, self._buffers[self.rank]), "cudaFree")
        _lib.check(lib.sk_host_free(self._host_error), "cudaFreeHost")
        self._opened = []

    @property
    def closed(self) -> bool:
        return self.id not in _registry

    def __enter__(self) -> CommWorkspace:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CommWorkspace(rank={self.rank}, world_size={self.world_size}, "
            f"device={self.device}, max_bytes={self.max_bytes}, "
            f"bytes_per_gpu={self.layout.total_bytes}, {self.tuning})"
        )

    # ---------------------------------------------------------------------------- errors

    def error(self) -> str | None:
        """Description of the recorded failure, or None. Reads host memory the kernel writes:
        no device synchronisation, safe to call at any time (also between graph replays)."""
        if self.closed:
            return None
        words = (ctypes.c_uint32 * _lib.CTRL_WORDS).from_address(self._host_error)
        if words[_lib.CTRL_ERR_CODE] == 0:
            return None
        call = words[_lib.CTRL_ERR_EPOCH_HIGH] << 32 | words[_lib.CTRL_ERR_EPOCH]
        return (
            f"rank {self.rank}/{self.world_size}: timed out after {self.tuning.timeout_ms} ms "
            f"waiting for rank {words[_lib.CTRL_ERR_SRC]} "
            f"({_PHASES.get(words[_lib.CTRL_ERR_KIND], '?')} phase) in call "
            f"{call}; outputs of that call and of every later call are "
            "invalid: close this workspace and create a new one"
        )

    def check_error(self) -> None:
        """Raises CommTimeoutError if a kernel of this workspace gave up on a peer."""
        message = self.error()
        if message is not None:
            raise CommTimeoutError(message)

    # ---------------------------------------------------------------------------- launching

    def _base_params(self, device_error: int) -> _lib.LaunchParams:
        p = _lib.LaunchParams()
        for peer, base in enumerate(self._buffers):
            p.lamport[peer] = base + self.layout.lamport_offset
            p.push[peer] = base + self.layout.push_offset
            p.gather[peer] = base + self.layout.gather_offset
            p.flags[peer] = base
        p.control = self._buffers[self.rank] + CONTROL_OFFSET
        p.error_host = device_error
        p.slot_bytes = self.layout.slot_bytes
        p.lamport_slot_bytes = self.layout.lamport_slot_bytes
        p.timeout_ns = self.tuning.timeout_ms * 1_000_000
        p.rank = self.rank
        p.world_size = self.world_size
        p.debug_delay_rank = -1
        p.row_blocks = 1
        p.early_launch = int(self.tuning.early_launch)
        return p

    def _set_debug(
        self,
        *,
        single_buffer: bool = False,
        trigger_at_start: bool = False,
        delay_rank: int = -1,
        delay_us: int = 0,
        timeline: torch.Tensor | None = None,
    ) -> None:
        """Test and profiling hooks. single_buffer: one one-shot buffer, never cleared, and one
        two-shot parity (UNSAFE: proves the buffer-reuse test can fail); trigger_at_start: with
        early_launch, each kernel lets the next one launch before waiting for any peer (UNSAFE:
        proves the launch-skew test can fail); delay_us stalls
        `delay_rank` after its one-shot push and after each two-shot wait; timeline (int64
        [TIMELINE_WORDS] on this device) receives block 0's clock64 at each phase of every
        later launch (0 start, 1 state read, 2 pushed, 3 cleared / first round done, 4 reduced /
        gathered, 5 end; words 6 and 7: %globaltimer at phases 0 and 5)."""
        self._params.debug_flags = (_lib.DEBUG_SINGLE_BUFFER if single_buffer else 0) | (
            _lib.DEBUG_TRIGGER_AT_START if trigger_at_start else 0
        )
        self._params.debug_delay_rank = delay_rank
        self._params.debug_delay_ns = delay_us * 1000
        if timeline is not None and (
            timeline.dtype != torch.int64
            or timeline.numel() < _lib.TIMELINE_WORDS
            or timeline.device != self.device
        ):
            raise ValueError(f"timeline must be int64 [>= {_lib.TIMELINE_WORDS}] on {self.device}")
        self._params.timeline = None if timeline is None else timeline.data_ptr()

    def plan(self, nbytes: int, variant: int = -1) -> tuple[int, int]:
        """(variant, blocks) this workspace uses for a message of nbytes; variant -1 = auto."""
        if variant < 0:
            variant = choose_variant(nbytes, self.tuning, self.layout)
        elif variant not in VARIANT_NAMES:
            raise ValueError(f"variant {variant} unknown: {VARIANT_NAMES}")
        if variant == _lib.VARIANT_ONESHOT and nbytes > self.layout.lamport_slot_bytes:
            raise ValueError(
                f"one-shot needs the message ({nbytes} bytes) to fit a one-shot slot "
                f"({self.layout.lamport_slot_bytes} bytes): raise oneshot_max_bytes at creation"
            )
        if variant == _lib.VARIANT_TWOSHOT_LAMPORT and not twoshot_lamport_fits(
            nbytes, self.world_size, self.layout.lamport_slot_bytes
        ):
            raise ValueError(
                f"the Lamport two-shot needs every rank's chunk of the message ({nbytes} bytes) "
                f"non-empty and two chunks to fit a Lamport slot "
                f"({self.layout.lamport_slot_bytes} bytes): raise twoshot_lamport_max_bytes "
                "at creation"
            )
        return variant, choose_blocks(nbytes, self.tuning)

    def launch(
        self,
        *,
        inp: torch.Tensor,
        out: torch.Tensor,
        variant: int = -1,
        residual_in: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
        weight: torch.Tensor | None = None,
        eps: float = 0.0,
    ) -> None:
        """Enqueues one call on the current stream. Inputs must already be validated
        (ops.py does it); fused when residual_in is given."""
        if self.closed:
            raise WorkspaceError(f"workspace {self.id} (rank {self.rank}) is closed")
        nbytes = inp.numel() * inp.element_size()
        auto_variant = variant < 0
        variant, blocks = self.plan(nbytes, variant)
        if auto_variant and residual_in is not None:
            variant = fused_variant(
                inp.shape[0], inp.shape[1], variant, blocks, self.tuning, self.layout
            )
        p = _lib.LaunchParams.from_buffer_copy(self._params)
        p.input = inp.data_ptr()
        p.output = out.data_ptr()
        p.numel = inp.numel()
        p.variant = variant
        p.blocks = blocks
        p.dtype = _DTYPE_CODES[inp.dtype]
        norm = None
        if residual_in is not None:
            p.fused = _lib.FUSED_RMSNORM
            p.residual_in = residual_in.data_ptr()
            p.residual_out = residual_out.data_ptr()
            p.weight = weight.data_ptr()
            p.rows = inp.shape[0]
            p.hidden = inp.shape[1]
            p.eps = eps
            per_row = row_blocks(p.rows, p.hidden, variant, self.tuning)
            if per_row > 1:
                # One cluster of per_row blocks per row (the grid follows the rows).
                p.row_blocks = per_row
                p.blocks = blocks = p.rows * per_row
            elif split_fused(p.rows, blocks, self.tuning, variant):
                # All-reduce into `out`, then add + RMSNorm in place, one block per row.
                norm = _lib.LaunchParams.from_buffer_copy(p)
                norm.fused = _lib.FUSED_NORM_ONLY
                norm.input = out.data_ptr()
                norm.blocks = p.rows
                p.fused = _lib.FUSED_NONE
        stream = ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)
        lib = _lib.lib()
        _lib.check(
            lib.sk_launch(ctypes.byref(p), self.device.index, stream),
            f"launch ({VARIANT_NAMES[variant]}, {blocks} blocks)",
        )
        if norm is not None:
            _lib.check(
                lib.sk_launch(ctypes.byref(norm), self.device.index, stream),
                f"launch (add + RMSNorm, {norm.blocks} blocks)",
            )


def _shared_settings(
    max_bytes: int, tuning: Tuning, layout: WorkspaceLayout
) -> tuple[tuple[str, Any], ...]:
    """What every rank must have alike, as (name, value) pairs. The kernel ABI and the buffer
    layout come from each rank's installed package: ranks of two versions would map each
    other's buffers with different flag widths or offsets and exchange garbage."""
    return (
        ("kernel ABI", _lib.ABI_VERSION),
        ("max_bytes", max_bytes),
        ("oneshot_max_bytes", tuning.oneshot_max_bytes),
        ("twoshot_lamport_max_bytes", tuning.twoshot_lamport_max_bytes),
        ("block_bytes", tuning.block_bytes),
        ("max_blocks", tuning.max_blocks),
        ("fused_rows_per_block", tuning.fused_rows_per_block),
        ("row_split_blocks", tuning.row_split_blocks),
        ("buffer layout", layout),
    )


def _disagreement(all_settings: list[Any]) -> str | None:
    """What the ranks' settings differ in (each value by rank), or None when they agree. A
    rank whose settings are not the same list of names runs another version (before ABI 6
    they were bare values)."""
    names = {
        repr([p[0] if isinstance(p, tuple) and len(p) == 2 else None for p in settings])
        for settings in all_settings
    }
    if len(names) > 1:
        return (
            "ranks run different sgl-kernel-sm120 versions (their settings, by rank: "
            f"{all_settings}): install the same version on every rank"
        )
    differing = [
        f"{name}: {[settings[i][1] for settings in all_settings]}"
        for i, (name, _) in enumerate(all_settings[0])
        if len({repr(settings[i]) for settings in all_settings}) > 1
    ]
    if not differing:
        return None
    return (
        "ranks disagree on " + "; ".join(differing) + " (by rank): use the same sgl-kernel-sm120 "
        "version, arguments and SGLANG_SM120_* variables on every rank"
    )


def _agree(group: Any, error: str | None, payload: Any, stage: str) -> list[Any]:
    """All-gathers (error, payload); every rank raises if any rank reported an error."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (error, payload), group=group)
    errors = [e for e, _ in gathered if e]
    if errors:
        raise WorkspaceError(f"workspace creation failed while {stage}: " + "; ".join(errors))
    return [p for _, p in gathered]


def _p2p_problems(rank: int, dev: int, bus_ids: list[str]) -> str | None:
    """Why this rank's GPU cannot write to some peer's GPU, or None."""
    lib = _lib.lib()
    problems = []
    for peer, bus in enumerate(bus_ids):
        if bus == bus_ids[rank]:
            continue  # same GPU: plain device memory
        peer_dev = ctypes.c_int(-1)
        if lib.sk_device_by_pci_bus_id(bus.encode(), ctypes.byref(peer_dev)) != 0:
            continue  # not visible here (CUDA_VISIBLE_DEVICES): opening the IPC handle decides
        ok = ctypes.c_int(0)
        code = lib.sk_can_access_peer(dev, peer_dev.value, ctypes.byref(ok))
        if code != 0 or not ok.value:
            problems.append(
                f"no P2P access from {bus_ids[rank]} (rank {rank}) to {bus} (rank {peer})"
            )
    if not problems:
        return None
    return "; ".join(problems) + " - use NCCL (P2P needs e.g. a driver with P2P enabled)"
