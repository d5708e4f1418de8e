"""End to end: a FLUX-like diffusion transformer run with SDPA and with the INT8 attention processor.

    python benchmarks/example_model.py [--tokens 4096] [--text-tokens 512] [--double 1] [--single 3]
                                       [--sdpa-backend auto] [--out results.jsonl]

The model has FLUX's structure at FLUX's width (hidden 3072 = 24 heads x 128, adaLN modulation, q/k RMSNorm,
rotary embeddings, double-stream blocks with joint text-image attention, then single-stream blocks), random
bf16 weights (nothing is downloaded). Its attention modules duck-type diffusers' FluxAttention, so the
processors are the ones a diffusers pipeline would take via `set_attn_processor`. Three runs share weights and
inputs: SDPA, INT8, and no attention at all (the core returns V), which gives the attention share of the time.
Reported: output agreement (cosine of the outputs and of the blocks' residual updates) and CUDA-event medians.
"""

import argparse
import contextlib
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from _load import load_package

SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}


class FluxLikeAttention(nn.Module):
    """The attributes diffusers' FluxAttention exposes to its processor."""

    def __init__(self, dim, heads, *, joint, pre_only):
        super().__init__()
        head_dim = dim // heads
        self.heads, self.processor = heads, None
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.norm_q, self.norm_k = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-6)
        if joint:
            self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, dim) for _ in range(3))
            self.norm_added_q, self.norm_added_k = nn.RMSNorm(head_dim, eps=1e-6), nn.RMSNorm(head_dim, eps=1e-6)
            self.to_add_out = nn.Linear(dim, dim)
        if not pre_only:
            self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])

    def forward(self, hidden_states, encoder_hidden_states=None, image_rotary_emb=None):
        return self.processor(self, hidden_states, encoder_hidden_states, image_rotary_emb=image_rotary_emb)


def modulate(x, shift, scale):
    return F.layer_norm(x, x.shape[-1:], eps=1e-6) * (1 + scale) + shift


def feed_forward(dim):
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))


class DoubleStreamBlock(nn.Module):
    """Image and text streams with their own weights, one joint attention (FLUX's MM-DiT block)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.modulation = nn.Linear(dim, 12 * dim)
        self.attn = FluxLikeAttention(dim, heads, joint=True, pre_only=False)
        self.ff, self.ff_context = feed_forward(dim), feed_forward(dim)

    def forward(self, x, context, temb, rotary):
        mods = self.modulation(F.silu(temb)).unsqueeze(1).chunk(12, dim=-1)
        (shift1, scale1, gate1, shift2, scale2, gate2), context_mods = mods[:6], mods[6:]
        c_shift1, c_scale1, c_gate1, c_shift2, c_scale2, c_gate2 = context_mods
        attn, attn_context = self.attn(modulate(x, shift1, scale1), modulate(context, c_shift1, c_scale1), rotary)
        x = x + gate1 * attn
        context = context + c_gate1 * attn_context
        x = x + gate2 * self.ff(modulate(x, shift2, scale2))
        context = context + c_gate2 * self.ff_context(modulate(context, c_shift2, c_scale2))
        return x, context


class SingleStreamBlock(nn.Module):
    """Text and image tokens concatenated; attention and MLP in parallel (FLUX's single-stream block)."""

    def __init__(self, dim, heads):
        super().__init__()
        self.modulation = nn.Linear(dim, 3 * dim)
        self.attn = FluxLikeAttention(dim, heads, joint=False, pre_only=True)
        self.proj_mlp, self.proj_out = nn.Linear(dim, 4 * dim), nn.Linear(5 * dim, dim)

    def forward(self, x, temb, rotary):
        shift, scale, gate = self.modulation(F.silu(temb)).unsqueeze(1).chunk(3, dim=-1)
        h = modulate(x, shift, scale)
        mixed = torch.cat([self.attn(h, image_rotary_emb=rotary), F.gelu(self.proj_mlp(h), approximate="tanh")],
                          dim=-1)
        return x + gate * self.proj_out(mixed)


class FluxLikeTransformer(nn.Module):
    def __init__(self, dim, heads, n_double, n_single):
        super().__init__()
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(dim, heads) for _ in range(n_double))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(dim, heads) for _ in range(n_single))

    def set_attn_processor(self, processor):
        for module in self.modules():
            if isinstance(module, FluxLikeAttention):
                module.processor = processor

    def forward(self, x, context, temb, rotary):
        for block in self.double_blocks:
            x, context = block(x, context, temb, rotary)
        x = torch.cat([context, x], dim=1)
        for block in self.single_blocks:
            x = block(x, temb, rotary)
        return x[:, context.shape[1]:]


def rotary_emb(n, head_dim, device):
    """(cos, sin) [n, head_dim] over 1-D positions, each angle repeated for its (even, odd) pair as in FLUX."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.arange(n, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    return angles.cos().repeat_interleave(2, dim=-1).float(), angles.sin().repeat_interleave(2, dim=-1).float()


def make_processors(ai8, sdpa_backend):
    """SDPA, INT8 and no-attention processors: one class, so projections, norms and rotary are identical."""
    base = ai8.layers.Int8AttnProcessor

    class SDPAProcessor(base):
        def attention(self, q, k, v, attention_mask):
            with sdpa_kernel(SDPA_BACKENDS[sdpa_backend]) if sdpa_backend != "auto" else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return out.transpose(1, 2)

    class NoAttentionProcessor(base):
        def attention(self, q, k, v, attention_mask):
            return v

    return {"sdpa": SDPAProcessor(), "int8": base(), "none": NoAttentionProcessor()}


def time_forward(model, inputs, warmup, repeats):
    """Median milliseconds of one forward (CUDA events)."""
    for _ in range(warmup):
        model(*inputs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        model(*inputs)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def cos_sim(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="image tokens (4096: a 1024x1024 FLUX image)")
    parser.add_argument("--text-tokens", type=int, default=512)
    parser.add_argument("--double", type=int, default=1, help="double-stream blocks")
    parser.add_argument("--single", type=int, default=3, help="single-stream blocks")
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--sdpa-backend", choices=["auto", *SDPA_BACKENDS], default="auto",
                        help="baseline backend (auto: what torch picks, i.e. what a pipeline gets)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", help="append the result as one JSON line to this file (default: stdout)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("example_model: no CUDA GPU on this machine; the INT8 kernel needs one")
        return 0

    ai8, loaded_from = load_package()
    torch.set_grad_enabled(False)
    dim, device, dtype = args.heads * args.head_dim, "cuda", torch.bfloat16
    model = FluxLikeTransformer(dim, args.heads, args.double, args.single).to(device, dtype)
    x = torch.randn(args.batch, args.tokens, dim, device=device, dtype=dtype)
    context = torch.randn(args.batch, args.text_tokens, dim, device=device, dtype=dtype)
    temb = torch.randn(args.batch, dim, device=device, dtype=dtype)
    inputs = (x, context, temb, rotary_emb(args.text_tokens + args.tokens, args.head_dim, device))

    outputs, ms = {}, {}
    for name, processor in make_processors(ai8, args.sdpa_backend).items():
        model.set_attn_processor(processor)
        outputs[name] = model(*inputs)
        ms[name] = time_forward(model, inputs, args.warmup, args.repeats)

    attention_ms = {name: ms[name] - ms["none"] for name in ("sdpa", "int8")}
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "model": f"{args.double} double + {args.single} single blocks, hidden {dim} ({args.heads}x{args.head_dim}), "
                 f"{args.batch}x({args.text_tokens}+{args.tokens}) tokens, bf16",
        "sdpa_backend": args.sdpa_backend,
        "output_cos": cos_sim(outputs["int8"], outputs["sdpa"]),
        "update_cos": cos_sim(outputs["int8"] - x, outputs["sdpa"] - x),
        "ms_sdpa": ms["sdpa"], "ms_int8": ms["int8"], "ms_without_attention": ms["none"],
        "speedup": ms["sdpa"] / ms["int8"],
        "attention_share_sdpa": attention_ms["sdpa"] / ms["sdpa"],
        "attention_speedup": attention_ms["sdpa"] / attention_ms["int8"],
    }
    print(f"attention_int8: {loaded_from}\n{result['gpu']}, torch {result['torch']}; {result['model']}\n")
    print("| attention | model ms | attention ms (model - no-attention run) | share of model time |")
    print("|---|---|---|---|")
    for name in ("sdpa", "int8"):
        label = f"SDPA ({args.sdpa_backend})" if name == "sdpa" else "INT8"
        print(f"| {label} | {ms[name]:.2f} | {attention_ms[name]:.2f} | {attention_ms[name] / ms[name]:.0%} |")
    print(f"| none | {ms['none']:.2f} | 0 | 0% |\n")
    print(f"end-to-end speedup {result['speedup']:.3f}x, attention speedup {result['attention_speedup']:.2f}x; "
          f"INT8 vs SDPA cosine: output {result['output_cos']:.6f}, residual update {result['update_cos']:.6f}")
    line = json.dumps(result)
    if args.out:
        with open(args.out, "a") as out_file:
            out_file.write(line + "\n")
    else:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
