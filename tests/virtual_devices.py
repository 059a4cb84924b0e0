"""Several GPUs emulated on the CPU, so that a test can show what only a multi-GPU machine would (issue 31): an
activation moved off its layer's device, or an operation on tensors of two devices (on a GPU: "Expected all
tensors to be on the same device").

`VirtualDevices` is a torch function mode. Every tensor has a placement, a torch.device such as cuda:1 (a tensor
never placed is on the CPU); the data itself always stays on the CPU. Inside the mode:
- `tensor.device` / `is_cuda` / `is_cpu` / `get_device()` report the placement;
- an operation's tensor outputs take the placement of its tensor operands, and operands of two placements raise
  DeviceMixing, as torch would -- except CPU 0-dim tensors (scalars, which torch lets meet any device), CPU
  indices of `x[...]`, and copies between devices, which torch makes (`copy_`, `x[slices] = y`: counted as
  moves);
- `.to(...)`, `.cpu()`, `.cuda()` and a `device=` argument (factories, `new_*`) place their result on the device
  asked for, and every change of placement is recorded in `moves`; a move from a GPU to the CPU is also added to
  `violations`: the code under test moved an activation off its device.
`split(model, devices)` places a transformers decoder model as accelerate's `device_map` does (embedding and
rotary tables on the first device, the decoder layers in contiguous runs, final norm and head on the last; a head
tied to the embedding stays with it) and installs accelerate's behaviour at each block's input: its tensor
arguments moved to the block's device (those moves are the dispatch's, not the code's: not recorded).

Branches on `device.type == "cuda"` see cuda: code that calls into torch.cuda (or Triton) on that branch does not
run under the mode; the tests drive torch-only readers.
"""
from __future__ import annotations

import traceback
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

CPU = torch.device("cpu")
_GETTERS = {torch.Tensor.device: "device", torch.Tensor.is_cuda: "is_cuda", torch.Tensor.is_cpu: "is_cpu"}
_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


class DeviceMixing(RuntimeError):
    """Operands of one operation on two devices."""


@dataclass(frozen=True)
class Move:
    source: torch.device
    target: torch.device
    shape: tuple[int, ...]
    where: str            # the innermost frame of the code under test


def _device(spec) -> torch.device:
    """A device argument as torch reads it; "cuda" without an index is the current device, cuda:0."""
    dev = torch.device(f"cuda:{spec}" if isinstance(spec, int) else spec)
    return torch.device("cuda", 0) if dev.type == "cuda" and dev.index is None else dev


def _is_device(arg) -> bool:
    if isinstance(arg, torch.device):
        return True
    if isinstance(arg, str):
        try:
            torch.device(arg)
            return True
        except RuntimeError:
            return False
    return False


def _where() -> str:
    """The innermost frame outside torch, transformers and this module: the line that asked."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename
        if __file__ not in name and "/torch/" not in name and "/transformers/" not in name:
            return f"{name.rsplit('/', 2)[-2]}/{name.rsplit('/', 1)[-1]}:{frame.lineno} ({frame.name})"
    return "?"


class VirtualDevices(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self._placed = WeakIdKeyDictionary()
        self._dispatching = False
        self.moves: list[Move] = []
        self.violations: list[str] = []
        self.layer_devices: list[torch.device] = []  # split(): each decoder layer's device
        self.computed_on: set[torch.device] = set()   # every placement an operation ran on

    # -- placements ---------------------------------------------------------------------------------------------
    def placement(self, t: torch.Tensor) -> torch.device:
        return self._placed.get(t, CPU)

    def place(self, t: torch.Tensor, device) -> torch.Tensor:
        self._placed[t] = _device(device)
        return t

    @contextmanager
    def split(self, model: torch.nn.Module, devices: list):
        """Within the block, `model` (a transformers ...ForCausalLM) is placed over `devices` as accelerate's
        device_map places it, and each block's tensor arguments are moved to its device as accelerate's hooks
        move them (the hooks are removed on leaving: the model is the CPU model again)."""
        devices = [_device(d) for d in devices]
        inner, layers = model.model, model.model.layers
        per = -(-len(layers) // len(devices))
        blocks = [(inner.embed_tokens, devices[0]), (inner.rotary_emb, devices[0]), (inner.norm, devices[-1]),
                  (model.lm_head, devices[-1])]
        self.layer_devices = [devices[i // per] for i in range(len(layers))]
        blocks += list(zip(layers, self.layer_devices))
        handles = []
        for module, dev in blocks:
            tied = [self._placed[t] for t in module.parameters() if t in self._placed]
            dev = tied[0] if tied else dev  # a weight tied to an earlier block's (the head to the embedding) stays
            for t in (*module.parameters(), *module.buffers()):
                self.place(t, dev)
            handles.append(module.register_forward_pre_hook(self._dispatch_to(dev), with_kwargs=True))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def _dispatch_to(self, device: torch.device):
        def hook(_module, args, kwargs):
            self._dispatching = True
            try:
                move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
                return pytree.tree_map(move, args), pytree.tree_map(move, kwargs)
            finally:
                self._dispatching = False
        return hook

    # -- the mode -----------------------------------------------------------------------------------------------
    def _moved(self, source: torch.Tensor, out: torch.Tensor, target: torch.device) -> torch.Tensor:
        src = self.placement(source)
        if src != target:
            if out is source:  # torch returns the tensor itself when nothing changes on the CPU: never retag it
                out = out.clone()
            if not self._dispatching:
                move = Move(src, target, tuple(source.shape), _where())
                self.moves.append(move)
                if src.type != "cpu" and target.type == "cpu":
                    self.violations.append(f"{move.where}: a tensor {list(move.shape)} moved from {src} to the CPU")
        return self.place(out, target)

    def _operands(self, func, args, kwargs) -> set[torch.device]:
        tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if func in _INDEXING:  # x[idx] (= v): CPU indices are allowed with a tensor on any device
            index = [x for x in pytree.tree_leaves(args[1]) if isinstance(x, torch.Tensor)]
            tensors = [t for t in tensors if not any(t is i for i in index) or self.placement(t) != CPU]
        places = {self.placement(t) for t in tensors if not (t.dim() == 0 and self.placement(t) == CPU)}
        if len(places) > 1:
            name = getattr(func, "__qualname__", repr(func))
            message = f"{_where()}: {name} on tensors of {sorted(map(str, places))}"
            self.violations.append(message)
            raise DeviceMixing(message)
        self.computed_on |= places
        return places

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        getter = getattr(func, "__self__", None)
        if getattr(func, "__name__", None) == "__get__" and getter in _GETTERS:
            dev = self.placement(args[0])
            return {"device": dev, "is_cuda": dev.type == "cuda", "is_cpu": dev.type == "cpu"}[_GETTERS[getter]]
        if func is torch.Tensor.get_device:
            dev = self.placement(args[0])
            return -1 if dev.type == "cpu" else dev.index
        if func in _MOVES:
            return self._move(func, args, kwargs)
        if func is torch.Tensor.copy_ or func is torch.Tensor.__setitem__ and not any(
                isinstance(x, torch.Tensor) for x in pytree.tree_leaves(args[1])):
            # a copy, between devices too (x[slices] = y copies): the destination keeps its placement
            dst, src = args[0], args[-1]
            if isinstance(src, torch.Tensor) and self.placement(src) != self.placement(dst) and not self._dispatching:
                self.moves.append(Move(self.placement(src), self.placement(dst), tuple(src.shape), _where()))
            return func(*args, **kwargs)
        if func is torch.Tensor.numpy and self.placement(args[0]).type != "cpu":
            raise TypeError(f"can't convert {self.placement(args[0])} device type tensor to numpy")
        if "device" in kwargs:  # a factory (or new_*) asked for a device
            target = kwargs.pop("device")
            out = func(*args, **kwargs)
            if target is None:
                target = self.placement(args[0]) if args and isinstance(args[0], torch.Tensor) else CPU
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.place(t, target)
            return out
        places = self._operands(func, args, kwargs)
        out = func(*args, **kwargs)
        target = places.pop() if places else CPU
        inputs = {id(x) for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in inputs:
                self.place(t, target)
        return out

    def _move(self, func, args, kwargs):
        source, rest = args[0], list(args[1:])
        if func is torch.Tensor.cpu:
            target = CPU
        elif func is torch.Tensor.cuda:
            target = _device(rest.pop(0) if rest else kwargs.pop("device", None) or "cuda")
        else:  # to(device | dtype | tensor, ..., device=, dtype=, ...)
            target = kwargs.pop("device", None)
            kept = []
            for a in rest:
                if isinstance(a, torch.Tensor):
                    target, a = self.placement(a), a.dtype
                elif _is_device(a) or isinstance(a, int) and not isinstance(a, bool):
                    target, a = a, None
                if a is not None:
                    kept.append(a)
            rest = kept
            target = self.placement(source) if target is None else _device(target)
        out = torch.Tensor.to(source, *rest, **kwargs) if func is torch.Tensor.to else source
        return self._moved(source, out, target)


__all__ = ["VirtualDevices", "DeviceMixing", "Move"]
