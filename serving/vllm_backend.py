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
    pack_side); positions below n_sink go to the page's sink rows in fp16, post-RoPE;
  * a sequence's single new token attends through the fused CPU kernel reading the slots where they lie (a page
    table of serving/pages.py's fields with the slot's strides, the outlier lists of fixed capacity read
    through per-row offsets); a chunk of several tokens (prefill) decodes its sequence's slots with the codec
    (exporters/vllm_slots.py unpack_side, exporters/codec.py decode), applies RoPE and attends causally (SDPA,
    float32) -- both read what is stored, as the serving cache does.
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
STATS: dict = {"kernel_calls": 0, "rows_calls": 0, "rows_written": 0, "overflow": {}, "seconds": {}}
PROFILE = os.environ.get("KVCALIB_VLLM_PROFILE") == "1"   # wall time of the write and the attention, in STATS


class PluginRefusal(ValueError):
    """An artifact or a vLLM setting the plugin cannot serve exactly; the message names the field."""


@dataclass
class Served:
    """One packed checkpoint folder as the plugin serves it."""
    folder: str
    manifest: dict
    policy: object
    layout: vllm_slots.SlotLayout
    cos: torch.Tensor                 # [N, D] float32 at positions 0..N-1 (the manifest's RoPE)
    sin: torch.Tensor
    kernel_rope: torch.Tensor | None  # [N, 2, D / 2]: cos then sin of the D / 2 frequencies (pre-RoPE keys)
    held: dict = field(default_factory=dict)


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
        m = artifact.manifest["model"]
        d = m["head_dim"]
        n = max(int(mc.max_model_len), 1) + 1
        cos, sin = rope_cos_sin(torch.arange(n), d, m["rope"]["theta"], m["rope"].get("scaling"))
        kernel_rope = None
        if policy.key_rope == "pre":
            kernel_rope = torch.stack([cos[:, :d // 2], sin[:, :d // 2]], 1).contiguous()
        _SERVED[key] = Served(key, artifact.manifest, policy, vllm_slots.layout(policy, m["n_kv_heads"], d), cos,
                              sin, kernel_rope)
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
        served = _LAST[0]
        if served is None or type(spec) is not FullAttentionSpec or spec.state_content_bytes is not None:
            return super().customize_spec(spec)
        lay = served.layout
        padded = lay.page_bytes(spec.block_size) if lay.sink_bytes else None
        return replace(spec, dtype=torch.uint8, num_head_slots=1, state_content_bytes=lay.slot_bytes,
                       page_size_padded=padded)


@dataclass
class PackedMetadata:
    num_actual_tokens: int
    query_start_loc: list
    seq_lens: list
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    shared: dict = field(default_factory=dict)   # what every layer of the step derives alike, made by the first


class KvcalibBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.served = _LAST[0]

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        if self.served is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        qsl = cm.query_start_loc_cpu if cm.query_start_loc_cpu is not None else cm.query_start_loc.cpu()
        seq = cm.seq_lens.cpu()
        q_lens = (qsl[1:] - qsl[:-1]).long()
        n = int(qsl[-1])
        context = seq.long() - q_lens
        positions = (torch.arange(n) - torch.repeat_interleave(qsl[:-1].long(), q_lens)
                     + torch.repeat_interleave(context, q_lens))
        return PackedMetadata(cm.num_actual_tokens, qsl.tolist(), seq.tolist(), cm.block_table_tensor,
                              cm.slot_mapping, positions)


@dataclass
class _Layer:
    index: int
    key: object
    value: object


class KvcalibCPUImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.served = served_for(get_current_vllm_config())
        _LAST[0] = self.served
        self._layer: _Layer | None = None
        self._consts: dict = {}
        self._count: torch.Tensor | None = None
        if self.served is None:
            return
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
        md = attn_metadata
        n = md.num_actual_tokens
        if n and key is not None:
            self._write(lay, key[:n], value[:n], md, kv_cache)
        if PROFILE:
            t1 = time.perf_counter()
            STATS["seconds"]["write"] = STATS["seconds"].get("write", 0.0) + t1 - t0
        qsl, seq = md.query_start_loc, md.seq_lens
        for i in range(len(seq)):
            a, b = qsl[i], qsl[i + 1]
            if b == a:
                continue
            if b - a == 1:
                o = self._decode_one(lay, query[a:b], md.block_table[i], seq[i], kv_cache, md.shared, ("table", i))
                if PROFILE:
                    STATS["seconds"]["decode"] = STATS["seconds"].get("decode", 0.0) + time.perf_counter() - t1
            else:
                o = self._attend_rows(lay, query[a:b], md.block_table[i], seq[i], kv_cache)
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
            k, v = self.served.policy.layers[i]
            self._layer = _Layer(i, k, v)
        return self._layer

    def _sink_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The pages' sink rows: [num_blocks, n_sink, 2, H, D] fp16 after each page's slots."""
        lay = self.served.layout
        nb, _, bs, c = kv_cache.shape
        raw = torch.as_strided(kv_cache, (nb, lay.sink_bytes), (kv_cache.stride(0), 1),
                               kv_cache.storage_offset() + bs * c)
        return raw.view(torch.float16).view(nb, lay.n_sink, 2, lay.n_kv_heads, lay.head_dim)

    def _write(self, lay: _Layer, key, value, md: PackedMetadata, kv_cache: torch.Tensor) -> None:
        sl = self.served.layout
        n = key.shape[0]
        bs = kv_cache.shape[2]
        step = md.shared.get("write")
        if step is None:
            pos = md.positions[:n]
            slots = md.slot_mapping[:n].long()
            blk, off = slots // bs, slots % bs
            sink = pos < sl.n_sink
            any_sink = bool(sink.any())
            step = md.shared["write"] = {"pos": pos, "blk": blk, "off": off, "sink": sink, "any_sink": any_sink,
                                         "rel": (blk * kv_cache.stride(0) + off * sl.slot_bytes).tolist(),
                                         "pos_list": pos.tolist()}
        if not step["any_sink"] and n <= FAST_ROWS and cpu_attention.available() and self._fast_write(
                lay, key, value, step, kv_cache):
            STATS["rows_written"] += n
            return
        pos, blk, off, sink = step["pos"], step["blk"], step["off"], step["sink"]
        rows = torch.ones(n, dtype=torch.bool)
        if step["any_sink"]:
            view = self._sink_view(kv_cache)
            view[blk[sink], pos[sink], 0] = key[sink].to(torch.float16)
            view[blk[sink], pos[sink], 1] = value[sink].to(torch.float16)
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
        STATS["rows_written"] += m
        if over:
            STATS["overflow"][lay.index] = STATS["overflow"].get(lay.index, 0) + over

    def _fast_write(self, lay: _Layer, key, value, step: dict, kv_cache: torch.Tensor) -> bool:
        """A few tokens (a decode step) encoded by the library straight into their slots, token by token: the
        bytes the torch path packs (the encoder is the codec's to the bit), with no temporary per field. False when
        the policy is not the library's or a token's outliers exceed a slot (the caller's path then stores the
        step, clamping the excess)."""
        sl = self.served.layout
        if cpu_attention._encoder_consts(lay.key) is None or cpu_attention._encoder_consts(lay.value) is None:
            return False
        if self._count is None:
            self._count = torch.zeros(1, dtype=torch.int16)
        rope = self.served.kernel_rope if self.served.policy.key_rope == "pre" else None
        k32, v32 = key.to(torch.float16).float(), value.to(torch.float16).float()  # the fp16 copies, as _write
        h, d = sl.n_kv_heads, sl.head_dim
        base0 = kv_cache.data_ptr()
        for j, (rel, p) in enumerate(zip(step["rel"], step["pos_list"])):
            base = base0 + rel
            for s, x, pol, r in ((sl.key, k32[j], lay.key, rope), (sl.value, v32[j], lay.value, None)):
                got = cpu_attention.encode_into(x.view(1, h, 1, d), pol, p, r, base + s.codes,
                                                None if s.scale is None else base + s.scale,
                                                None if s.zero is None else base + s.zero,
                                                None if not s.cap else base + s.index,
                                                None if not s.cap else base + s.value, s.cap, self._count)
                if got < 0:
                    return False
                if s.cap and got < s.cap:   # the entries left: the sentinel index, value 0
                    ctypes.memmove(base + s.index + 2 * got, _SENTINELS.data_ptr(), 2 * (s.cap - got))
                    ctypes.memset(base + s.value + 2 * got, 0, 2 * (s.cap - got))
        return True

    def _page_consts(self, bs: int) -> tuple:
        """Per block size: each side's outlier counts (its capacity, every row: empty entries hold the sentinel)
        and the rows' offsets into the lists (t * slot_bytes / 2 int16 entries), shared by every page."""
        if bs not in self._consts:
            sl = self.served.layout
            caps = [torch.full((bs,), s.cap, dtype=torch.int16) for s in (sl.key, sl.value)]
            offs = torch.arange(bs, dtype=torch.int64) * (sl.slot_bytes // 2)
            self._consts[bs] = (caps, offs)
        return self._consts[bs]

    def _page_table(self, block_row, t: int, kv_cache: torch.Tensor) -> tuple:
        """The page table of one sequence's t rows with addresses relative to the layer's cache (every layer of a
        step shares it: the same blocks at the same strides), and the masks that make it absolute for a layer:
        table = relative + byte_fields * base + half_fields * (base / 2). -> (relative [P, N_PAGE], byte mask,
        half mask, the sink rows' relative address or None, their count)."""
        sl = self.served.layout
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
        (kcap, vcap), offs = self._page_consts(bs)
        table = torch.zeros(nb, N_PAGE, dtype=torch.int64)
        byte_f = torch.zeros(N_PAGE, dtype=torch.int64)
        half_f = torch.zeros(N_PAGE, dtype=torch.int64)
        table[:, 0], table[:, 1] = start, rows
        for col, s, caps in ((2, sl.key, kcap), (2 + N_SIDE, sl.value, vcap)):
            f = table[:, col:col + N_SIDE]
            f[:, 0] = base + s.codes
            byte_f[col] = 1
            f[:, 2], f[:, 3], f[:, 4] = s.code_bytes, c, 1
            if s.scale is not None:
                f[:, 5], f[:, 6] = (base + s.scale) // 2, (base + s.zero) // 2
                f[:, 8], f[:, 9] = 1, c // 2
                half_f[col + 5] = half_f[col + 6] = 1
            if s.cap:
                f[:, 11], f[:, 12] = caps.data_ptr() // 2, offs.data_ptr() // 8
                f[:, 13], f[:, 14] = (base + s.index) // 2, (base + s.value) // 2
                half_f[col + 13] = half_f[col + 14] = 1
        table = table[rows > 0].contiguous()
        sink_rel = int(page0[0]) + bs * c if s0 else None
        return table, byte_f, half_f, sink_rel, s0

    def _decode_one(self, lay: _Layer, q, block_row, t: int, kv_cache: torch.Tensor, shared: dict | None = None,
                    key=None) -> torch.Tensor:
        sl = self.served.layout
        held = None if shared is None else shared.get(key)
        if held is None:
            held = self._page_table(block_row, t, kv_cache)
            if shared is not None:
                shared[key] = held
        rel, byte_f, half_f, sink_rel, s0 = held
        base = kv_cache.data_ptr()
        table = rel + byte_f * base + half_f * (base // 2)
        sink = cpu_attention._Rows()
        if s0:
            h, d = sl.n_kv_heads, sl.head_dim
            kp = base + sink_rel
            strides = (ctypes.c_int64 * 4)(0, d, 2 * h * d, 1)
            sink = cpu_attention._Rows(kp, kp + 2 * h * d, strides, (ctypes.c_int64 * 4)(0, d, 2 * h * d, 1), s0)
        (kcap, vcap), offs = self._page_consts(kv_cache.shape[2])
        keep: list = [kcap, vcap, offs]
        out = cpu_attention.launch(table if table.shape[0] else torch.zeros(1, N_PAGE, dtype=torch.int64),
                                   table.shape[0], q, sl.n_kv_heads, self.scale, lay.key, lay.value,
                                   (sl.key.cap > 0, sl.value.cap > 0), self.served.kernel_rope, sink,
                                   cpu_attention._Rows(), None, cpu_attention.CHUNK, torch.get_num_threads(), keep)
        STATS["kernel_calls"] += 1
        return out[0]

    def _attend_rows(self, lay: _Layer, q, block_row, t: int, kv_cache: torch.Tensor) -> torch.Tensor:
        """Several new tokens of one sequence (prefill): its stored rows decoded, RoPE applied, causal SDPA."""
        sl = self.served.layout
        bs = kv_cache.shape[2]
        nb = -(-t // bs)
        blocks = block_row[:nb].long()
        s0 = min(sl.n_sink, t)
        ks, vs = [], []
        if s0:
            sink = self._sink_view(kv_cache)[blocks[0], :s0].float()           # [s0, 2, H, D]
            ks.append(sink[:, 0].permute(1, 0, 2).unsqueeze(0))
            vs.append(sink[:, 1].permute(1, 0, 2).unsqueeze(0))
        if t > s0:
            slots = kv_cache[blocks, 0].reshape(nb * bs, -1)[s0:t]
            k = decode(vllm_slots.unpack_side(slots, sl.key, lay.key, sl.n_kv_heads, sl.head_dim), lay.key)
            if self.served.policy.key_rope == "pre":
                k = apply_rope(k, self.served.cos[s0:t], self.served.sin[s0:t])
            v = decode(vllm_slots.unpack_side(slots, sl.value, lay.value, sl.n_kv_heads, sl.head_dim), lay.value)
            ks.append(k)
            vs.append(v)
        kk, vv = torch.cat(ks, 2), torch.cat(vs, 2)                              # [1, H, t, D]
        nq = q.shape[0]
        qq = q.float().permute(1, 0, 2).unsqueeze(0)                             # [1, H_q, nq, D]
        outs = []
        for a in range(0, nq, QUERY_CHUNK):   # queries in chunks: the scores of a chunk are [H_q, chunk, t]
            b = min(nq, a + QUERY_CHUNK)
            end = t - nq + b                   # the chunk's last query sees rows < end
            mask = torch.arange(end)[None, :] <= torch.arange(t - nq + a, end)[:, None]
            outs.append(F.scaled_dot_product_attention(qq[:, :, a:b], kk[:, :, :end], vv[:, :, :end], attn_mask=mask,
                                                       scale=self.scale, enable_gqa=True))
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
            row["layout"] = impl.served.layout.as_json()
        out.append(row)
    return sorted(out, key=lambda r: r["layer"])
