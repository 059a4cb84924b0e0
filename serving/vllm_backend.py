"""kvcalib's vLLM attention backend: vLLM's CPU engine stores K/V in a kvcalib artifact's packed slots and attends
from them (docs/vllm.md, "The kvcalib vLLM plugin"). Imported only inside vLLM's environment (.venv-vllm), by the
plugin's entry point (serving/vllm_plugin.py).

The backend takes vLLM's CPU_ATTN name (vllm/v1/attention/backends/registry.py register_backend: vLLM's CPU
platform always selects CPU_ATTN, vllm/platforms/cpu.py get_attn_backend_cls) and serves two kinds of model:
- a folder without a packed kvcalib artifact (a plain model, an fp8 checkpoint): exactly vLLM's CPU attention (its
  cache write, then its forward; nothing of ours runs);
- a kvcalib checkpoint folder of a packed recipe (pipeline export-vllm; exporters/vllm_slots.py refusals empty):
  the folder is verified whole when the first attention layer is built (exporters.compressed_tensors.
  verify_checkpoint: the artifact strictly, every file's sha256), every vLLM setting the slots cannot serve exactly
  is refused naming it (settings_refusals), and then
  * the KV spec is the packed page (customize_spec: one head slot of `slot_bytes` per token, uint8, the sink rows
    after a page's slots via page_size_padded): vLLM sizes its cache, and reports its capacity, from it;
  * each step's new rows are written into their slots (forward_includes_kv_cache_update): keys rotated back to
    pre-RoPE at their positions (the manifest's RoPE, exporters/rope.py), encoded by the CPU kernel's encoder (the
    codec's bytes, serving/cpu_attention.py encode_rows) or the codec, packed (exporters/vllm_slots.py
    pack_side, the static-bound outliers after the previous token's in the page's pool: pool_places); positions
    below n_sink go to the page's sink rows in fp16, post-RoPE;
  * a sequence's single new token attends through the fused CPU kernel reading the slots where they lie (a page
    table of serving/pages.py's fields with the slot's strides; a slot's outlier list of fixed capacity, or the
    page's pool of static-bound outliers, read through per-row counts and offsets); a chunk of several tokens
    (prefill) decodes its sequence's slots with the codec (exporters/vllm_slots.py unpack_side, exporters/codec.py
    decode), applies RoPE and attends causally (SDPA, float32) -- both read what is stored, as the serving cache
    does.
STATS counts what ran and every outlier left clamped beyond a slot's capacity, per layer.
"""
from __future__ import annotations

import ctypes
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadataBuilder)
from vllm.v1.kv_cache_interface import FullAttentionSpec

from exporters import vllm_slots
from exporters.codec import decode, encode
from exporters.compressed_tensors import ARTIFACT_DIR, is_checkpoint, verify_checkpoint
from exporters.layout import store
from exporters.rope import apply_rope, invert_rope, rope_cos_sin
from serving import cpu_attention
from serving.pages import N_PAGE, N_SIDE

LAYER = re.compile(r"layers\.(\d+)\.")
QUERY_CHUNK = 512    # prefill queries attended per SDPA call
FAST_ROWS = 8        # a step of at most this many new tokens is encoded straight into its slots
_SENTINELS = torch.full((4096,), vllm_slots.SENTINEL, dtype=torch.int16)   # empty outlier entries to copy from
RING_SLACK = 4      # recent-window rings beyond max_num_seqs (sequences finished but not yet seen gone)
STATS: dict = {"kernel_calls": 0, "kernel_rows": 0, "rows_calls": 0, "rows_written": 0, "overflow": {}, "seconds": {},
               "window_misses": 0, "window_ring_bytes": 0, "padding_loss": 0.0, "slot_bytes": {}}
PROFILE = os.environ.get("KVCALIB_VLLM_PROFILE") == "1"   # wall time of the write and the attention, in STATS


class PluginRefusal(ValueError):
    """An artifact or a vLLM setting the plugin cannot serve exactly; the message names the field."""


@dataclass
class Served:
    """One packed checkpoint folder as the plugin serves it."""
    folder: str
    manifest: dict
    policy: object
    layout: vllm_slots.SlotLayout     # layer 0's slot (the heads, head_dim and sink rows every layer shares)
    cos: torch.Tensor                 # [N, D] float32 at positions 0..N-1 (the manifest's RoPE)
    sin: torch.Tensor
    kernel_rope: torch.Tensor | None  # [N, 2, D / 2]: cos then sin of the D / 2 frequencies (pre-RoPE keys)
    held: dict = field(default_factory=dict)
    layouts: list = field(default_factory=list)   # every layer's slot (its own fields, its own size)
    window: "Window | None" = None                # the recent window's rings (policy.residual > 0)

    def slot(self, layer: int) -> vllm_slots.SlotLayout:
        return self.layouts[layer] if self.layouts else self.layout

    @property
    def widest(self) -> vllm_slots.SlotLayout:
        return max(self.layouts or [self.layout], key=lambda s: s.slot_bytes)


class Window:
    """The recent window's fp16 rows (docs/manifest.md, "Residual window and sinks"; docs/vllm.md, "The recent
    window"): per running sequence its S sink rows (row p < S at p) and a ring of R rows (row p >= S at S + p mod R),
    in every layer (the layers' rings are
    KvcalibCPUImpl.ring; this object is what all layers share: which ring a sequence holds, and the position each
    ring row holds). A sequence is known by its first block: with prefix caching off (the plugin turns it off for a
    windowed recipe) a block belongs to one running sequence. Rings are taken least recently used first; a row a
    step needs whose ring no longer holds it (a ring taken by another sequence) is read from its slot instead --
    counted in STATS["window_misses"], never silently."""

    def __init__(self, residual: int, n_sink: int, rings: int) -> None:
        self.residual, self.n_sink, self.rings = residual, n_sink, rings
        self.owner: dict[int, int] = {}                          # first block -> ring
        self.stamp = [0] * rings                                 # the step each ring was last used at
        self.key = [None] * rings
        self.tags = torch.full((rings, n_sink + residual), -1, dtype=torch.int64)   # the position each row holds
        self.step = 0

    def index(self, p):
        """Where position p (an int or an integer tensor) lies in its sequence's rows: p < S at p, else S + p mod R."""
        if isinstance(p, torch.Tensor):
            return torch.where(p < self.n_sink, p, self.n_sink + p % self.residual)
        return p if p < self.n_sink else self.n_sink + p % self.residual

    def encoded_end(self, n: int) -> int:
        """e(n) of the flush rule for a flush unit of 1: the first row a query at position n - 1 reads in fp16 past
        the sinks (docs/manifest.md, appending step 2)."""
        return max(min(self.n_sink, n), n - self.residual)

    def _take(self, key: int) -> int:
        if len(self.owner) < self.rings:
            ring = next(i for i in range(self.rings) if self.key[i] is None)
        else:
            ring = min(range(self.rings), key=self.stamp.__getitem__)
            if self.stamp[ring] == self.step:
                raise PluginRefusal(f"kvcalib vLLM plugin: more sequences in one step than the recent window's "
                                    f"{self.rings} rings (max_num_seqs + {RING_SLACK})")
            del self.owner[self.key[ring]]
        self.owner[key] = ring
        self.key[ring] = key
        self.tags[ring] = -1
        return ring

    def plan(self, first_blocks: list[int], context: list[int], seq: list[int], q_lens: list[int]) -> dict:
        """One step: each sequence's ring, the first row its queries read in fp16 from before the step (`lo`,
        rows [lo, context) come from the ring; a lost row moves lo up to context), and which of the step's rows go
        into which ring row (the rows a later query reads in fp16: p >= max(S, seq_len - R))."""
        self.step += 1
        rings, lo = [], []
        store_tok, store_ring, store_idx = [], [], []
        start = 0
        if len(set(first_blocks)) < len(first_blocks):
            raise PluginRefusal("kvcalib vLLM plugin: two running sequences share their first block: a recipe with a "
                                "recent window is served with prefix caching off (enable_prefix_caching=False)")
        for key, c, n, m in zip(first_blocks, context, seq, q_lens):
            ring = self.owner.get(key)
            if ring is None:   # a new sequence (or one whose ring was taken): what it wrote before is not held
                ring = self._take(key)
            self.stamp[ring] = self.step
            rings.append(ring)
            sinks = torch.arange(min(self.n_sink, c))
            if not bool((self.tags[ring, sinks] == sinks).all()):   # no copy of a sink row anywhere else
                raise PluginRefusal(f"kvcalib vLLM plugin: a running sequence's sink rows are no longer held (its "
                                    f"ring was taken: more sequences than max_num_seqs + {RING_SLACK} at once?)")
            a = self.encoded_end(c + 1)
            if a < c:
                want = torch.arange(a, c)
                if not bool((self.tags[ring, self.index(want)] == want).all()):
                    STATS["window_misses"] = STATS.get("window_misses", 0) + (c - a)
                    a = c
            lo.append(a)
            p = torch.arange(c, n)
            p = p[(p < self.n_sink) | (p >= n - self.residual)]   # sink rows, and the rows a later query reads
            if p.numel():
                store_tok.append(p - c + start)
                store_ring.append(torch.full_like(p, ring))
                store_idx.append(self.index(p))
                self.tags[ring, self.index(p)] = p
            start += m
        cat = (lambda xs: torch.cat(xs) if xs else torch.zeros(0, dtype=torch.int64))  # noqa: E731
        return {"rings": rings, "lo": lo, "tok": cat(store_tok), "ring": cat(store_ring), "idx": cat(store_idx)}


_SERVED: dict[str, Served | None] = {}
_LAST: list = [None]      # the Served of the model whose attention layers were built last in this process


def settings_refusals(vllm_config, manifest: dict, policy) -> list[str]:
    """Every vLLM setting under which the packed slots would not be served exactly, naming it."""
    out = []
    cache, par, mc = vllm_config.cache_config, vllm_config.parallel_config, vllm_config.model_config
    if cache.cache_dtype != "auto":
        out.append(f"kv_cache_dtype: the plugin stores the artifact's own packed cache; allowed 'auto', got "
                   f"{cache.cache_dtype!r}")
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "decode_context_parallel_size"):
        got = getattr(par, name, 1)
        if got != 1:
            out.append(f"{name}: a slot holds every kv head of a token (per-token outlier bounds span all heads); "
                       f"allowed 1, got {got}")
    if getattr(vllm_config, "speculative_config", None) is not None:
        out.append("speculative_config: not served by the plugin; allowed None")
    m = manifest["model"]
    checks = (("n_kv_heads", mc.get_num_kv_heads(par), m["n_kv_heads"]), ("head_dim", mc.get_head_size(), m["head_dim"]),
              ("n_layers", mc.get_num_layers(par), m["n_layers"]))
    for name, got, want in checks:
        if got != want:
            out.append(f"model.{name}: the artifact was calibrated for {want}, vLLM's model has {got}")
    archs = list(getattr(mc.hf_config, "architectures", None) or [])
    if m["architecture"] not in archs:
        out.append(f"model.architecture: the artifact's is {m['architecture']!r}, the folder's config names {archs}")
    if m.get("attention") or mc.get_sliding_window():
        out.append("model.attention: sliding-window (local) layers are not served by the plugin; allowed every "
                   "layer global")
    if m["rope"].get("pairing", "rotate_half") != "rotate_half":
        out.append(f"model.rope.pairing: allowed 'rotate_half', got {m['rope'].get('pairing')!r}")
    if policy.n_sink > cache.block_size:
        out.append(f"block_size: the sink rows live in a sequence's first page; allowed >= cache.n_sink "
                   f"({policy.n_sink}), got {cache.block_size}")
    return out


def served_for(vllm_config) -> Served | None:
    """The packed checkpoint vLLM is serving, verified and checked against the settings (PluginRefusal /
    CheckpointError naming what differs), or None for any other model (vLLM's own attention serves it)."""
    mc = getattr(vllm_config, "model_config", None)
    folder = Path(str(getattr(mc, "model", "") or ""))
    if mc is None or not folder.is_dir() or not is_checkpoint(folder):
        return None
    key = str(folder.resolve())
    if key not in _SERVED:
        from exporters.artifact import read_manifest
        manifest = read_manifest(folder / ARTIFACT_DIR)
        if manifest["layers"][0]["key"]["format"] == "fp8":   # an fp8 checkpoint: vLLM's own fp8 cache serves it
            _SERVED[key] = None
            return None
        try:
            artifact = verify_checkpoint(folder)          # the folder whole: artifact, checksums, config
        except ValueError as exc:                         # ManifestError and its kinds: name the folder and refuse
            raise PluginRefusal(f"kvcalib vLLM plugin: {folder}: the checkpoint does not verify: "
                                f"{type(exc).__name__}: {exc}") from exc
        policy = artifact.policy
        problems = vllm_slots.refusals(policy)
        if problems:
            raise PluginRefusal(f"kvcalib vLLM plugin: {folder}: the artifact's recipe {policy.name!r} is not "
                                f"servable: " + "; ".join(problems))
        rings = int(getattr(vllm_config.scheduler_config, "max_num_seqs", 128) or 128) + RING_SLACK
        _SERVED[key] = served_of(key, artifact, max(int(mc.max_model_len), 1) + 1, rings)
    served = _SERVED[key]
    if served is not None:
        problems = settings_refusals(vllm_config, served.manifest, served.policy)
        if problems:
            raise PluginRefusal(f"kvcalib vLLM plugin: {folder}: " + "; ".join(problems))
    return served


# ---- the backend ---------------------------------------------------------------------------------------------

class KvcalibCPUBackend(CPUAttentionBackend):
    forward_includes_kv_cache_update: bool = True    # the packed write needs the step's positions

    @staticmethod
    def get_impl_cls():
        return KvcalibCPUImpl

    @staticmethod
    def get_builder_cls():
        return KvcalibBuilder

    @classmethod
    def customize_spec(cls, spec):
        """The packed page of the layer vLLM asks for (_SPEC_LAYER: the runner asks each attention layer for its
        spec, then this backend to customize it): that layer's slot, so that layers of different bits have pages
        of their own sizes in one group (vLLM's UniformTypeKVCacheSpecs: every page holds the same tokens). Asked
        without a layer (vLLM's page-size probes), the widest slot."""
        served = _LAST[0]
        if served is None or type(spec) is not FullAttentionSpec or spec.state_content_bytes is not None:
            return super().customize_spec(spec)
        i = _SPEC_LAYER[0]
        lay = served.slot(i) if i is not None and i < len(served.layouts) else served.widest
        if i is not None and i < len(served.layouts):
            STATS["slot_bytes"][i] = lay.slot_bytes
            natural = {j: served.slot(j).slot_bytes for j in STATS["slot_bytes"]}
            STATS["padding_loss"] = vllm_slots.padding_loss(STATS["slot_bytes"], natural)
        page = lay.page_bytes(spec.block_size)   # the slots, then the outlier pools and the sink rows (no window)
        padded = page if page != spec.block_size * lay.slot_bytes else None
        return replace(spec, dtype=torch.uint8, num_head_slots=1, state_content_bytes=lay.slot_bytes,
                       page_size_padded=padded)


_SPEC_LAYER: list = [None]   # the index of the attention layer vLLM last asked for its KV spec


def _layer_aware_specs() -> None:
    """Wrap vLLM's Attention.get_kv_cache_spec (once per process) to note which layer asks, for customize_spec."""
    from vllm.model_executor.layers.attention.attention import Attention

    original = Attention.get_kv_cache_spec
    if getattr(original, "_kvcalib", False):
        return

    def get_kv_cache_spec(self, vllm_config):
        m = LAYER.search(str(getattr(self, "layer_name", "")))
        _SPEC_LAYER[0] = int(m.group(1)) if m else None
        return original(self, vllm_config)

    get_kv_cache_spec._kvcalib = True
    Attention.get_kv_cache_spec = get_kv_cache_spec


_layer_aware_specs()


@dataclass
class PackedMetadata:
    num_actual_tokens: int
    query_start_loc: list
    seq_lens: list
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    shared: dict = field(default_factory=dict)   # what every layer of the step derives alike, made by the first
    window: dict | None = None                   # Window.plan of the step (a recipe with a recent window)


class KvcalibBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.served = _LAST[0]

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        """The step's metadata, made once per step: layers of different page sizes form attention groups of their
        own, each with a builder, and vLLM builds every group of a step from one CommonAttentionMetadata object (a
        new one each step) -- the window's plan must run once (a second plan would see the first one's rows)."""
        if self.served is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        if _STEP[0] is cm:
            return _STEP[1]
        qsl = cm.query_start_loc_cpu if cm.query_start_loc_cpu is not None else cm.query_start_loc.cpu()
        seq = cm.seq_lens.cpu()
        q_lens = (qsl[1:] - qsl[:-1]).long()
        n = int(qsl[-1])
        context = seq.long() - q_lens
        positions = (torch.arange(n) - torch.repeat_interleave(qsl[:-1].long(), q_lens)
                     + torch.repeat_interleave(context, q_lens))
        md = PackedMetadata(cm.num_actual_tokens, qsl.tolist(), seq.tolist(), cm.block_table_tensor,
                            cm.slot_mapping, positions)
        if self.served.window is not None:
            first = cm.block_table_tensor[:len(md.seq_lens), 0].tolist()
            md.window = self.served.window.plan(first, context.tolist(), md.seq_lens, q_lens.tolist())
        _STEP[:] = [cm, md]
        return md


_STEP: list = [None, None]   # the last step's CommonAttentionMetadata and the PackedMetadata made from it


@dataclass
class _Layer:
    index: int
    key: object
    value: object
    slot: vllm_slots.SlotLayout = None
    unrotate: torch.Tensor | None = None    # rotated values: y @ unrotate un-rotates a value row


def layer_of(served: Served, i: int) -> _Layer:
    """Layer i's policies, slot and value un-rotation as the plugin serves them."""
    from serving.inputs import value_unrotation

    k, v = served.policy.layers[i]
    return _Layer(i, k, v, served.slot(i), value_unrotation(v, served.layout.head_dim, torch.device("cpu")))


def served_of(folder: str, artifact, max_positions: int, rings: int = 1) -> Served:
    """A verified packed artifact as the plugin serves it (served_for's Served, without vLLM's config): every
    layer's slot, the RoPE tables for max_positions, a recent window's rings."""
    policy, m = artifact.policy, artifact.manifest["model"]
    d, h = m["head_dim"], m["n_kv_heads"]
    cos, sin = rope_cos_sin(torch.arange(max_positions), d, m["rope"]["theta"], m["rope"].get("scaling"))
    kernel_rope = None
    if policy.key_rope == "pre":
        kernel_rope = torch.stack([cos[:, :d // 2], sin[:, :d // 2]], 1).contiguous()
    layouts = [vllm_slots.layout(policy, h, d, i) for i in range(len(policy.layers))]
    window = Window(policy.residual, policy.n_sink, rings) if policy.residual else None
    return Served(folder, artifact.manifest, policy, layouts[0], cos, sin, kernel_rope, layouts=layouts,
                  window=window)


def _starts_page(off: int, pos: int, n_sink: int) -> bool:
    """Whether the token at page offset `off` (position `pos`) is its page's first stored one: offset 0, or the
    position after the sinks (which have no slot entries). Its pool entries then start at 0."""
    return off == 0 or pos - 1 < n_sink


def _checked_fill(fill: int, cap: int, blk: int, off: int) -> int:
    if not 0 <= fill <= cap:
        raise RuntimeError(f"kvcalib vLLM plugin: block {blk}: the outlier pool's fill before row {off} is {fill}, "
                           f"outside [0, {cap}] (a page the plugin did not write in position order)")
    return fill


class KvcalibCPUImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.held_state(served_for(get_current_vllm_config()), self.scale)
        _LAST[0] = self.served
        if self.served is None:
            return
        if not cpu_attention.available():   # the fused kernel reads every single-token step
            raise PluginRefusal(f"kvcalib vLLM plugin: the CPU kernel is not available: "
                                f"{cpu_attention.status().get('reason')} (scripts/install-vllm.sh builds it: "
                                f"python -m serving.cpu_attention build)")
        window = self.served.window
        if window is not None:   # this layer's rings, sized up front and taken from what vLLM may give its cache
            m = self.served.manifest["model"]
            self.ring = torch.zeros(window.rings, window.n_sink + window.residual, 2, m["n_kv_heads"],
                                    m["head_dim"], dtype=torch.float16)
            nbytes = self.ring.numel() * 2
            STATS["window_ring_bytes"] += nbytes
            cache = get_current_vllm_config().cache_config
            if cache.kv_cache_memory_bytes is not None:
                cache.kv_cache_memory_bytes = max(0, int(cache.kv_cache_memory_bytes) - nbytes)
        bad = []
        if self.attn_type != AttentionType.DECODER:
            bad.append(f"attn_type: allowed 'decoder', got {self.attn_type!r}")
        if self.sliding_window != -1:
            bad.append(f"sliding_window: allowed None, got {self.sliding_window}")
        if self.alibi_slopes is not None or self.sinks is not None or self.logits_soft_cap:
            bad.append("alibi_slopes / sinks / logits_soft_cap: allowed none (the kernel computes plain softmax "
                       "attention)")
        if self.kv_sharing_target_layer_name is not None:
            bad.append(f"kv_sharing_target_layer_name: allowed None, got {self.kv_sharing_target_layer_name!r}")
        if bad:
            raise PluginRefusal("kvcalib vLLM plugin: " + "; ".join(bad))

    def held_state(self, served: "Served | None", scale: float, layer: "_Layer | None" = None,
                   ring: torch.Tensor | None = None) -> None:
        """What the plugin holds per attention layer besides vLLM's own: the packed checkpoint served, the softmax
        scale, the layer's policies (bound at its first call), its rings, and what it makes once -- per block size
        the pages' constant arrays, per slot layout its token encoders and its kernel launch. (vLLM's __init__
        calls it; the tests build a bare layer with it.)"""
        self.served, self.scale, self._layer, self.ring = served, scale, layer, ring
        self._consts: dict = {}
        self._encoders: dict = {}
        self._launchers: dict = {}
        self._count: torch.Tensor | None = None

    # -- plain models: vLLM's own CPU attention, its write first (forward_includes_kv_cache_update) --
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if self.served is None:
            if (attn_metadata is not None and key is not None and value is not None
                    and self.kv_sharing_target_layer_name is None
                    and self.attn_type not in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER)):
                super().do_kv_cache_update(layer, key, value, kv_cache, attn_metadata.slot_mapping)
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the kvcalib plugin")
        if attn_metadata is None:   # warm-up
            return output
        t0 = time.perf_counter() if PROFILE else 0.0
        lay = self.bind(layer)
        if kv_cache.shape[-1] != lay.slot.slot_bytes:   # a page of another size than the one customize_spec gave
            if kv_cache.shape[-1] < lay.slot.slot_bytes:
                raise PluginRefusal(f"kvcalib vLLM plugin: layer {lay.index}: vLLM's page holds "
                                    f"{kv_cache.shape[-1]} bytes per token, its slot needs {lay.slot.slot_bytes}")
            lay.slot = replace(lay.slot, slot_bytes=int(kv_cache.shape[-1]))   # padded: the fields where they are
        if kv_cache.shape[0] > 1 and kv_cache.stride(0) < lay.slot.page_bytes(kv_cache.shape[2]):
            raise PluginRefusal(f"kvcalib vLLM plugin: layer {lay.index}: vLLM's page holds {kv_cache.stride(0)} "
                                f"bytes, its slots, outlier pools and sink rows need "
                                f"{lay.slot.page_bytes(kv_cache.shape[2])}")
        md = attn_metadata
        n = md.num_actual_tokens
        old = self._old_rows(md) if md.window is not None else {}
        if n and key is not None:
            self._write(lay, key[:n], value[:n], md, kv_cache)
        if PROFILE:
            t1 = time.perf_counter()
            STATS["seconds"]["write"] = STATS["seconds"].get("write", 0.0) + t1 - t0
        qsl, seq = md.query_start_loc, md.seq_lens
        win_of = (lambda i: None) if md.window is None else (  # noqa: E731
            lambda i: (md.window["rings"][i], md.window["lo"][i]))
        one = md.shared.get("decoding")
        if one is None:   # the sequences with one new token this step (the same in every layer)
            one = md.shared["decoding"] = [i for i in range(len(seq)) if qsl[i + 1] - qsl[i] == 1]
        if one:   # all of them in one launch
            at = [qsl[i] for i in one]
            o = self._decode_many(lay, query[at], [(md.block_table[i], seq[i], ("table", i), win_of(i)) for i in one],
                                  kv_cache, md.shared)
            output[at] = o.to(output.dtype)
            if PROFILE:
                STATS["seconds"]["decode"] = STATS["seconds"].get("decode", 0.0) + time.perf_counter() - t1
        for i in range(len(seq)):
            a, b = qsl[i], qsl[i + 1]
            if b - a <= 1:
                continue
            win = win_of(i)   # a prefill chunk: its rows decoded, each query reading what the evaluation reads
            new = None if win is None else (key[a:b].to(torch.float16), value[a:b].to(torch.float16))
            o = self._attend_rows(lay, query[a:b], md.block_table[i], seq[i], kv_cache, win, old.get(i), new)
            output[a:b] = o.to(output.dtype)
        if PROFILE:
            STATS["seconds"]["attend"] = STATS["seconds"].get("attend", 0.0) + time.perf_counter() - t1
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.served is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        raise RuntimeError("kvcalib plugin: the packed cache is written by forward (forward_includes_kv_cache_update)")

    # -- the packed cache --
    def bind(self, layer) -> _Layer:
        """This layer's policies, by the layer's index in its name (model.layers.N.self_attn.attn)."""
        if self._layer is None:
            m = LAYER.search(layer.layer_name)
            if m is None:
                raise PluginRefusal(f"kvcalib vLLM plugin: layer {layer.layer_name!r}: no layer index in its name")
            i = int(m.group(1))
            n_layers = len(self.served.policy.layers)
            if i >= n_layers:
                raise PluginRefusal(f"kvcalib vLLM plugin: layer {layer.layer_name!r}: the artifact has {n_layers} layers")
            self._layer = layer_of(self.served, i)
        return self._layer

    def _old_rows(self, md: PackedMetadata) -> dict:
        """Before the step's write: the fp16 rows each prefill chunk reads from its ring -- its sink rows before the
        chunk, then the rows [lo, context) -- (the write may put the chunk's own rows over them).
        -> {sequence: [m, 2, H, D] fp16, sinks first}."""
        out = {}
        qsl, window = md.query_start_loc, self.served.window
        for i, (ring, lo) in enumerate(zip(md.window["rings"], md.window["lo"])):
            c = md.seq_lens[i] - (qsl[i + 1] - qsl[i])
            if qsl[i + 1] - qsl[i] > 1 and c:
                p = torch.cat([torch.arange(min(window.n_sink, c)), torch.arange(min(max(lo, window.n_sink), c), c)])
                out[i] = self.ring[ring, window.index(p)].clone()
        return out

    def _sink_view(self, kv_cache: torch.Tensor, sl: vllm_slots.SlotLayout) -> torch.Tensor:
        """The pages' sink rows: [num_blocks, n_sink, 2, H, D] fp16 after each page's slots and pools."""
        nb, _, bs, _ = kv_cache.shape
        raw = torch.as_strided(kv_cache, (nb, sl.sink_bytes), (kv_cache.stride(0), 1),
                               kv_cache.storage_offset() + sl.sink_offset(bs))
        return raw.view(torch.float16).view(nb, sl.n_sink, 2, sl.n_kv_heads, sl.head_dim)

    @staticmethod
    def _pool_views(kv_cache: torch.Tensor, where: dict) -> tuple:
        """One side's outlier pool in every page (exporters/vllm_slots.py pools(): its byte offsets in a page) ->
        (count [nb, bs] int16, first [nb, bs] int16, index [nb, P] int16, value [nb, P] fp16), views."""
        nb, _, bs, _ = kv_cache.shape
        cap, at0, st = where["cap"], kv_cache.storage_offset(), kv_cache.stride(0)
        view = lambda off, n: torch.as_strided(kv_cache, (nb, 2 * n), (st, 1), at0 + off)  # noqa: E731
        return (view(where["count"], bs).view(torch.int16), view(where["first"], bs).view(torch.int16),
                view(where["index"], cap).view(torch.int16), view(where["value"], cap).view(torch.float16))

    @staticmethod
    def _pool_start(count, first, blk: int, off: int, pos: int, n_sink: int, cap: int) -> int:
        """The pool's fill before the token at page offset `off` (position `pos`): after the previous token's
        entries; 0 for a page's first stored token (offset 0, or the position after the sinks, which have no
        slot entries). A fill outside [0, cap] is a page this plugin did not write: refused."""
        if _starts_page(off, pos, n_sink):
            return 0
        return _checked_fill(int(first[blk, off - 1]) + int(count[blk, off - 1]), cap, blk, off)

    def _write(self, lay: _Layer, key, value, md: PackedMetadata, kv_cache: torch.Tensor) -> None:
        sl = lay.slot
        n = key.shape[0]
        if md.window is not None and md.window["tok"].numel():   # the fp16 rows later queries read, into the rings
            w = md.window
            self.ring[w["ring"], w["idx"], 0] = key[w["tok"]].to(torch.float16)
            self.ring[w["ring"], w["idx"], 1] = value[w["tok"]].to(torch.float16)
        bs = kv_cache.shape[2]
        step = md.shared.get(("write", sl))
        if step is None:
            pos = md.positions[:n]
            slots = md.slot_mapping[:n].long()
            blk, off = slots // bs, slots % bs
            sink = pos < sl.n_sink
            any_sink = bool(sink.any())
            step = md.shared[("write", sl)] = {"pos": pos, "blk": blk, "off": off, "sink": sink, "any_sink": any_sink,
                                         "rel": (blk * kv_cache.stride(0) + off * sl.slot_bytes).tolist(),
                                         "pos_list": pos.tolist()}
        if not step["any_sink"] and n <= FAST_ROWS and cpu_attention.available() and self._fast_write(
                lay, key, value, step, kv_cache):
            STATS["rows_written"] += n
            return
        pos, blk, off, sink = step["pos"], step["blk"], step["off"], step["sink"]
        rows = torch.ones(n, dtype=torch.bool)
        if step["any_sink"] and sl.sink_in_page:
            view = self._sink_view(kv_cache, sl)
            view[blk[sink], pos[sink], 0] = key[sink].to(torch.float16)
            view[blk[sink], pos[sink], 1] = value[sink].to(torch.float16)
        if step["any_sink"]:
            rows = ~sink
        m = int(rows.sum())
        if not m:
            return
        # the fp16 copies the spec encodes from (docs/manifest.md, appending step 1): vLLM hands the rows in the
        # model's dtype, which for a float32 model is not what the evaluation and serving/cache.py encode
        k = key[rows].to(torch.float16).float().permute(1, 0, 2).unsqueeze(0)       # [1, H, m, D]
        v = value[rows].to(torch.float16).float().permute(1, 0, 2).unsqueeze(0)
        p_rows = pos[rows]
        if self.served.policy.key_rope == "pre":
            k = invert_rope(k, self.served.cos[p_rows], self.served.sin[p_rows])
        kb = cpu_attention.encode_rows(k, lay.key, 0)
        if kb is None:
            kb = store(encode(k, lay.key, f"layer {lay.index} keys"), lay.key, 0)
        vb = cpu_attention.encode_rows(v, lay.value, 0)
        if vb is None:
            vb = store(encode(v, lay.value, f"layer {lay.index} values"), lay.value, 0)
        payload = torch.zeros(m, sl.slot_bytes, dtype=torch.uint8)
        over = vllm_slots.pack_side(kb.tensors, sl.key, m, sl.n_kv_heads, payload)
        over += vllm_slots.pack_side(vb.tensors, sl.value, m, sl.n_kv_heads, payload)
        kv_cache[blk[rows], 0, off[rows]] = payload
        pools = sl.pools(bs)
        for name, stored in (("key", kb), ("value", vb)):
            if name in pools:
                over += self._place_pool(kv_cache, pools[name], stored.tensors, blk[rows], off[rows], p_rows,
                                         sl.n_sink)
        STATS["rows_written"] += m
        if over:
            STATS["overflow"][lay.index] = STATS["overflow"].get(lay.index, 0) + over

    def _place_pool(self, kv_cache: torch.Tensor, where: dict, tensors: dict, blk, off, pos, n_sink: int) -> int:
        """m tokens' outliers of one pooled side (stored rows, in the step's order: each page's tokens consecutive
        and ascending) into their pages' pools, each token's after the previous token's. -> those left out."""
        count, first, index, value = self._pool_views(kv_cache, where)
        m = blk.numel()
        counts, o_index, o_value = vllm_slots.outlier_lists(tensors, m)
        start = torch.full((m,), -1, dtype=torch.int64)
        head = torch.ones(m, dtype=torch.bool)   # a run's first token: its fill from the page (the previous token, or 0)
        head[1:] = (blk[1:] != blk[:-1]) | (off[1:] != off[:-1] + 1)
        for j in head.nonzero().flatten().tolist():
            start[j] = self._pool_start(count, first, int(blk[j]), int(off[j]), int(pos[j]), n_sink, where["cap"])
        at = vllm_slots.pool_places(counts, start, where["cap"])
        count[blk, off] = at["kept"].to(torch.int16)
        first[blk, off] = at["first"].to(torch.int16)
        keep, rows = at["keep"], at["rows"]
        index[blk[rows[keep]], at["dest"][keep]] = o_index[keep]
        value[blk[rows[keep]], at["dest"][keep]] = o_value[keep]
        return at["overflow"]

    def _fast_write(self, lay: _Layer, key, value, step: dict, kv_cache: torch.Tensor) -> bool:
        """A few tokens (a decode step) encoded by the library straight into their slots, token by token: the
        bytes the torch path packs (the encoder is the codec's to the bit), with no temporary per field; a pooled
        side's outliers after the previous token's in the page's pool. False when the policy is not the library's or
        a token's outliers exceed its slot or what is left of its page's pool (the caller's path then stores the
        step, clamping the excess)."""
        sl = lay.slot
        if cpu_attention._encoder_consts(lay.key) is None or cpu_attention._encoder_consts(lay.value) is None:
            return False
        if self._count is None:
            self._count = torch.zeros(1, dtype=torch.int16)
        rope = self.served.kernel_rope if self.served.policy.key_rope == "pre" else None
        k32 = key.to(torch.float16).float().contiguous()   # the fp16 copies, as _write
        v32 = value.to(torch.float16).float().contiguous()
        h, d = sl.n_kv_heads, sl.head_dim
        encoders = self._encoders.get(sl)   # this layer's, made once: their checks and fixed fields
        if encoders is None:
            encoders = self._encoders[sl] = {
                "key": cpu_attention.TokenEncoder(lay.key, h, d, rope, False, self._count),
                "value": cpu_attention.TokenEncoder(lay.value, h, d, None, False, self._count)}
        base0 = kv_cache.data_ptr()
        bs = kv_cache.shape[2]
        pools = sl.pools(bs)
        if pools and "blk_list" not in step:
            step["blk_list"], step["off_list"] = step["blk"].tolist(), step["off"].tolist()
        i16 = ctypes.c_int16
        for j, (rel, p) in enumerate(zip(step["rel"], step["pos_list"])):
            base = base0 + rel
            for name, s, x in (("key", sl.key, k32[j]), ("value", sl.value, v32[j])):
                enc = encoders[name]
                if name in pools:   # the page's pool, after the previous token's entries (_pool_start)
                    where = pools[name]
                    b, o = step["blk_list"][j], step["off_list"][j]
                    page = base0 + b * kv_cache.stride(0)
                    cnt, fst = page + where["count"] + 2 * o, page + where["first"] + 2 * o   # this token's fields
                    start = 0 if _starts_page(o, p, sl.n_sink) else _checked_fill(
                        i16.from_address(fst - 2).value + i16.from_address(cnt - 2).value, where["cap"], b, o)
                    got = enc(x.data_ptr(), p, base + s.codes, None if s.scale is None else base + s.scale,
                              None if s.zero is None else base + s.zero, page + where["index"] + 2 * start,
                              page + where["value"] + 2 * start, where["cap"] - start, x)
                    if got < 0:
                        return False
                    i16.from_address(cnt).value, i16.from_address(fst).value = got, start
                    continue
                got = enc(x.data_ptr(), p, base + s.codes, None if s.scale is None else base + s.scale,
                          None if s.zero is None else base + s.zero, None if not s.cap else base + s.index,
                          None if not s.cap else base + s.value, s.cap, x)
                if got < 0:
                    return False
                if s.cap and got < s.cap:   # the entries left: the sentinel index, value 0
                    ctypes.memmove(base + s.index + 2 * got, _SENTINELS.data_ptr(), 2 * (s.cap - got))
                    ctypes.memset(base + s.value + 2 * got, 0, 2 * (s.cap - got))
        return True

    def _page_consts(self, bs: int, sl: vllm_slots.SlotLayout) -> tuple:
        """Per block size and slot: each side's outlier counts (its capacity, every row: empty entries hold the
        sentinel) and the rows' offsets into the lists (t * slot_bytes / 2 int16 entries), shared by every page."""
        if (bs, sl) not in self._consts:
            caps = [torch.full((bs,), s.cap, dtype=torch.int16) for s in (sl.key, sl.value)]
            offs = torch.arange(bs, dtype=torch.int64) * (sl.slot_bytes // 2)
            self._consts[(bs, sl)] = (caps, offs)
        return self._consts[(bs, sl)]

    def _page_table(self, block_row, t: int, kv_cache: torch.Tensor, sl: vllm_slots.SlotLayout) -> tuple:
        """The page table of one sequence's t rows with addresses relative to the layer's cache (every layer of a
        step shares it: the same blocks at the same strides), and the masks that make it absolute for a layer:
        table = relative + byte_fields * base + half_fields * (base / 2). -> (relative [P, N_PAGE], byte mask,
        half mask, the sink rows' relative address or None, their count). Rows [n_sink, t) only: t is where the
        rows read decoded end (a recent window's fp16 rows are read apart)."""
        bs, c = kv_cache.shape[2], sl.slot_bytes
        nb = -(-t // bs)
        blocks = block_row[:nb].long()
        page0 = blocks * kv_cache.stride(0)
        start = torch.arange(nb, dtype=torch.int64) * bs
        rows = (t - start).clamp(max=bs)
        s0 = min(sl.n_sink, t)
        base = page0.clone()
        start[0] += s0
        rows[0] -= s0
        base[0] += s0 * c
        (kcap, vcap), offs = self._page_consts(bs, sl)
        table = torch.zeros(nb, N_PAGE, dtype=torch.int64)
        byte_f = torch.zeros(N_PAGE, dtype=torch.int64)
        half_f = torch.zeros(N_PAGE, dtype=torch.int64)
        table[:, 0], table[:, 1] = start, rows
        pools = sl.pools(bs)
        shift = torch.zeros(nb, dtype=torch.int64)   # the first page's rows start after its sinks: so do its pool
        shift[0] = 2 * s0                            # fields per row (count, first)
        for col, name, s, caps in ((2, "key", sl.key, kcap), (2 + N_SIDE, "value", sl.value, vcap)):
            f = table[:, col:col + N_SIDE]
            f[:, 0] = base + s.codes
            byte_f[col] = 1
            f[:, 2], f[:, 3], f[:, 4] = s.code_bytes, c, 1
            if s.scale is not None:
                f[:, 5], f[:, 6] = (base + s.scale) // 2, (base + s.zero) // 2
                f[:, 8], f[:, 9] = 1, c // 2
                half_f[col + 5] = half_f[col + 6] = 1
            if name in pools:   # the page's pool: count and first per row (int16), then its entries
                where = pools[name]
                f[:, 11], f[:, 12] = (page0 + where["count"] + shift) // 2, (page0 + where["first"] + shift) // 2
                f[:, 13], f[:, 14] = (page0 + where["index"]) // 2, (page0 + where["value"]) // 2
                for k in (11, 12, 13, 14):
                    half_f[col + k] = 1
            elif s.cap:
                f[:, 11], f[:, 12] = caps.data_ptr() // 2, offs.data_ptr() // 8
                f[:, 13], f[:, 14] = (base + s.index) // 2, (base + s.value) // 2
                half_f[col + 13] = half_f[col + 14] = 1
        table = table[rows > 0].contiguous()
        sink_rel = int(page0[0]) + sl.sink_offset(bs) if s0 else None
        return table, byte_f, half_f, sink_rel, s0

    def _decode_one(self, lay: _Layer, q, block_row, t: int, kv_cache: torch.Tensor, shared: dict | None = None,
                    key=None, win: tuple | None = None) -> torch.Tensor:
        """One sequence's new token (position t - 1): _decode_many of that one."""
        return self._decode_many(lay, q[None] if q.dim() == 2 else q, [(block_row, t, key, win)], kv_cache, shared)[0]

    def _decode_many(self, lay: _Layer, q, seqs: list, kv_cache: torch.Tensor, shared: dict | None = None):
        """Every decoding sequence's one new token in one fused-kernel launch: q [n, H_q, D] (a query per
        sequence; from a [1, H_q, D] slice per sequence), seqs [(block_row, t, key, win)] -- position t - 1; key:
        the step's table key of the sequence (its page table is the same in every layer), win: (ring, lo) with a
        recent window. Each sequence reads its sink rows (fp16, its ring's or its first page's), the rows
        [n_sink, e) decoded from their slots and, with a window, the rows [e, t) in fp16 from its ring, in place
        (e = max(e(t), lo)). What does not depend on the layer -- the page table relative to the cache, each
        sequence's rows -- is made once per step and slot layout (_step_reads); per layer, only the addresses of its
        cache and rings. -> [n, H_q, D] float32."""
        sl = lay.slot
        h, d = sl.n_kv_heads, sl.head_dim
        base = kv_cache.data_ptr()
        step = self._step_reads(sl, seqs, kv_cache, shared)
        n, strides, row = len(seqs), step["strides"], 4 * h * d   # bytes per ring / sink row: K then V
        sinks, recents = (cpu_attention._Rows * n)(), (cpu_attention._Rows * n)()
        window = self.served.window
        for j, (ring, s0, first, m, sink_rel, s0_page) in enumerate(step["rows"]):
            if ring is not None:   # the sequence's ring: its sink rows first, then the window's R rows
                kp = self.ring[ring].data_ptr()
                if s0:
                    sinks[j] = cpu_attention._Rows(kp, kp + 2 * h * d, strides, strides, s0)
                if m:
                    rp = kp + window.n_sink * row
                    recents[j] = cpu_attention._Rows(rp, rp + 2 * h * d, strides, strides, m, first, window.residual)
            if sink_rel is not None:
                kp = base + sink_rel
                sinks[j] = cpu_attention._Rows(kp, kp + 2 * h * d, strides, strides, s0_page)
        keep: list = [step]
        split = lay.unrotate is not None
        run = self._launchers.get((sl, q.shape[1]))   # this layer's, made once: its checks and fixed fields
        if run is None:
            run = self._launchers[(sl, q.shape[1])] = cpu_attention.Launcher(
                lay.key, lay.value, (sl.key.kernel_outliers, sl.value.kernel_outliers), self.served.kernel_rope, None,
                sl.n_kv_heads, q.shape[1], d, self.scale, split)
        out = run(step["table"], step["n_pages"], q, cpu_attention.CHUNK, torch.get_num_threads(), keep,
                  page_b=step["page_b"], sinks=sinks, recents=recents,
                  relative=(step["byte_f"], step["half_f"], base))
        STATS["kernel_calls"] += 1
        STATS["kernel_rows"] += len(seqs)
        if split:
            from serving.inputs import finish
            out = finish(out[0], out[1], lay.unrotate)
        return out

    def _step_reads(self, sl: vllm_slots.SlotLayout, seqs: list, kv_cache: torch.Tensor, shared: dict | None) -> dict:
        """What a step's decoding sequences read, the same in every layer of one slot layout: the page tables of all
        of them, relative to the layer's cache, one after another (each sequence's rows [n_sink, e)), each page's
        sequence, and per sequence (ring, sink rows in the ring, where its window's rows [e, t) start in the ring,
        how many, its first page's sink rows' relative address or None, their count)."""
        key = None if shared is None else ("reads", sl, tuple((s[1], s[2], s[3]) for s in seqs))
        held = None if key is None else shared.get(key)
        if held is not None:
            return held
        window = self.served.window
        tables, page_b, rows = [], [], []
        byte_f = half_f = None
        for j, (block_row, t, tkey, win) in enumerate(seqs):
            end, ring, first, m, s0 = t, None, 0, 0, 0
            if win is not None:
                ring, lo = win
                end = max(window.encoded_end(t), min(lo, t - 1), min(sl.n_sink, t))
                s0, m = min(sl.n_sink, t), t - end
                first = end % window.residual if m else 0   # row p >= S of the ring at S + p mod R
            pkey = None if tkey is None else (tkey, sl, end)
            table = None if shared is None or pkey is None else shared.get(pkey)
            if table is None:
                table = self._page_table(block_row, end, kv_cache, sl)
                if shared is not None and pkey is not None:
                    shared[pkey] = table
            rel, byte_f, half_f, sink_rel, s0_page = table
            if rel.shape[0]:
                tables.append(rel)
                page_b.append(torch.full((rel.shape[0],), j, dtype=torch.int64))
            rows.append((ring, s0, first, m, sink_rel if s0_page and sl.sink_in_page else None, s0_page))
        h, d = sl.n_kv_heads, sl.head_dim
        held = {"table": torch.cat(tables) if tables else torch.zeros(1, N_PAGE, dtype=torch.int64),
                "n_pages": sum(x.shape[0] for x in tables),
                "page_b": torch.cat(page_b) if page_b else torch.zeros(1, dtype=torch.int64), "rows": rows,
                "byte_f": byte_f if byte_f is not None else torch.zeros(N_PAGE, dtype=torch.int64),
                "half_f": half_f if half_f is not None else torch.zeros(N_PAGE, dtype=torch.int64),
                "strides": (ctypes.c_int64 * 4)(0, d, 2 * h * d, 1),
                "consts": self._page_consts(kv_cache.shape[2], sl)}   # the count / offset arrays tables point at
        if key is not None:
            shared[key] = held
        return held

    def _attend_rows(self, lay: _Layer, q, block_row, t: int, kv_cache: torch.Tensor, win: tuple | None = None,
                     old: torch.Tensor | None = None, new: tuple | None = None) -> torch.Tensor:
        """Several new tokens of one sequence (a prefill chunk, positions t - nq .. t - 1): its stored rows decoded,
        RoPE applied, causal SDPA in float32. With a recent window, each query reads exactly what the evaluation's
        one-token-at-a-time step reads (docs/manifest.md, "Reading"): the query at position p the rows [e(p + 1),
        p + 1) in fp16 -- from the ring (`old`, rows [lo, t - nq)) and from the chunk itself (`new`, its fp16 K and
        V) -- and the rows [n_sink, e(p + 1)) decoded; so a chunk's queries see the same rows however the prompt is
        cut into chunks."""
        sl = lay.slot
        bs = kv_cache.shape[2]
        nq = q.shape[0]
        c = t - nq
        s0 = min(sl.n_sink, t)
        if win is None:
            dec_end = t
        else:
            window = self.served.window
            lo = win[1]
            qpos = torch.arange(c, t)
            win_lo = torch.maximum(torch.maximum(qpos + 1 - window.residual, (qpos + 1).clamp(max=sl.n_sink)),
                                   torch.full_like(qpos, lo).clamp(max=c))              # per query: fp16 from here
            dec_end = int(win_lo[-1])
        nb = -(-max(dec_end, s0, 1) // bs)
        blocks = block_row[:nb].long()
        ks, vs = [], []
        if s0:
            if sl.sink_in_page:
                sink = self._sink_view(kv_cache, sl)[blocks[0], :s0].float()   # [s0, 2, H, D]
            else:   # the ring's sink rows before the chunk (`old` starts with them), the chunk's own after
                before = min(s0, c)
                parts = [] if old is None else [old[:before].float()]
                sink = torch.cat(parts + [torch.stack(new, 1)[:s0 - before].float()])
            ks.append(sink[:, 0].permute(1, 0, 2).unsqueeze(0))
            vs.append(sink[:, 1].permute(1, 0, 2).unsqueeze(0))
        if dec_end > s0:
            slots = kv_cache[blocks, 0].reshape(nb * bs, -1)[s0:dec_end]
            pooled = {}
            for name, where in sl.pools(bs).items():   # the rows' outliers from their pages' pools
                count, first, index, value = self._pool_views(kv_cache, where)
                rows = slice(s0, dec_end)
                pooled[name] = vllm_slots.pool_entries(count[blocks].reshape(-1)[rows], first[blocks].reshape(-1)[rows],
                                                       (torch.arange(nb * bs) // bs)[rows], index[blocks],
                                                       value[blocks])
            k = decode(vllm_slots.unpack_side(slots, sl.key, lay.key, sl.n_kv_heads, sl.head_dim, pooled.get("key")),
                       lay.key)
            if self.served.policy.key_rope == "pre":
                k = apply_rope(k, self.served.cos[s0:dec_end], self.served.sin[s0:dec_end])
            v = decode(vllm_slots.unpack_side(slots, sl.value, lay.value, sl.n_kv_heads, sl.head_dim,
                                              pooled.get("value")), lay.value)
            ks.append(k)
            vs.append(v)
        qq = q.float().permute(1, 0, 2).unsqueeze(0)                             # [1, H_q, nq, D]
        outs = []
        if win is None:
            kk, vv = torch.cat(ks, 2), torch.cat(vs, 2)                          # [1, H, t, D]
            for a in range(0, nq, QUERY_CHUNK):   # queries in chunks: the scores of a chunk are [H_q, chunk, t]
                b = min(nq, a + QUERY_CHUNK)
                end = t - nq + b                   # the chunk's last query sees rows < end
                mask = torch.arange(end)[None, :] <= torch.arange(t - nq + a, end)[:, None]
                outs.append(F.scaled_dot_product_attention(qq[:, :, a:b], kk[:, :, :end], vv[:, :, :end],
                                                           attn_mask=mask, scale=self.scale, enable_gqa=True))
        else:
            w0 = int(win_lo[0])                    # the fp16 rows [w0, t): the ring's [w0, c), the chunk's [c, t)
            fk, fv = [], []
            if w0 < c:   # `old`: the sink rows before the chunk, then the rows [max(lo, S), c)
                at = min(sl.n_sink, c) + w0 - max(lo, sl.n_sink)
                fk.append(old[at:, 0].float())
                fv.append(old[at:, 1].float())
            fk.append(new[0][max(w0, c) - c:].float())
            fv.append(new[1][max(w0, c) - c:].float())
            fk = torch.cat(fk).permute(1, 0, 2).unsqueeze(0)                     # [1, H, t - w0, D]
            fv = torch.cat(fv).permute(1, 0, 2).unsqueeze(0)
            kk, vv = torch.cat(ks + [fk], 2), torch.cat(vs + [fv], 2)
            n_dec = max(dec_end, s0)                                             # columns before the fp16 rows
            col = torch.cat([torch.arange(n_dec), torch.arange(w0, t)])         # each column's position
            is_fp = torch.arange(col.numel()) >= n_dec
            for a in range(0, nq, QUERY_CHUNK):
                b = min(nq, a + QUERY_CHUNK)
                p = qpos[a:b, None]
                wl = win_lo[a:b, None]
                # only the columns some query of the chunk reads: decoded [0, its largest wl) (the sinks among them),
                # fp16 from its smallest wl to its last position -- the rest are masked for all of them
                d_hi = max(s0, min(n_dec, int(win_lo[b - 1])))
                f_lo, f_hi = n_dec + max(int(win_lo[a]) - w0, 0), n_dec + (c + b - w0)
                cols = torch.cat([torch.arange(d_hi), torch.arange(f_lo, f_hi)])
                cc, fp = col[cols], is_fp[cols]
                mask = (cc[None] <= p) & (((cc < s0) & ~fp)[None] | (~fp[None] & (cc[None] < wl))
                                          | (fp[None] & (cc[None] >= wl)))
                outs.append(F.scaled_dot_product_attention(qq[:, :, a:b], kk[:, :, cols], vv[:, :, cols],
                                                           attn_mask=mask, scale=self.scale, enable_gqa=True))
        STATS["rows_calls"] += 1
        return torch.cat(outs, 2)[0].permute(1, 0, 2)


def held(model) -> list[dict]:
    """What every attention layer of a vLLM model serves from (for bench.vllm_serve's read-back): per layer its
    index, whether the plugin's packed cache serves it, and, when it does, the sha256 of each static tensor of its
    key and value policies as held (codebook, range, zero, lower, upper: float32 bytes) and the slot layout."""
    from vllm.model_executor.layers.attention.attention import Attention

    out = []
    for name, module in model.named_modules():
        if not isinstance(module, Attention):
            continue
        impl = module.impl
        m = LAYER.search(name)
        row = {"name": name, "layer": int(m.group(1)) if m else -1,
               "packed": isinstance(impl, KvcalibCPUImpl) and impl.served is not None}
        if row["packed"]:
            lay = impl.bind(module)
            row["bound_layer"] = lay.index
            for kind, p in (("key", lay.key), ("value", lay.value)):
                for tname in vllm_slots.POLICY_TENSORS:
                    t = getattr(p, tname, None)
                    if t is not None:
                        row[f"{kind}.{tname}"] = vllm_slots.tensor_digest(t)
            row["layout"] = lay.slot.as_json()
        out.append(row)
    return sorted(out, key=lambda r: r["layer"])
