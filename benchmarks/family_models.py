"""One real-architecture model of each family, built from its library's config with random weights (nothing is
downloaded), run with SDPA and with this package's attention through the library's own hook.

    python benchmarks/family_models.py [FAMILY ...] [--warmup 2] [--repeats 5] [--out results.jsonl]

FAMILY (default: all):
- llm: transformers' LlamaForCausalLM at Llama-3-8B's layer width (hidden 4096; 32 query and 8 KV heads of 128;
  FFN 14336), 4 layers, on a left-padded batch of 4 prompts of 4096, 3000, 2048 and 1024 tokens.
  `transformers_attention` registered with AttentionInterface (its padding mask runs one varlen call), against
  attn_implementation="sdpa" (which gets a 4-D mask).
- flux: diffusers' FluxTransformer2DModel at FLUX.1's width (24 heads of 128), 2 double- and 4 single-stream
  blocks, a 1024x1024 image (4096 tokens) and 512 text tokens.
- wan: diffusers' WanTransformer3DModel at Wan 2.1 1.3B's width (12 heads of 128, FFN 8960), 2 blocks, an
  81-frame 480x832 video (21 x 30 x 52 = 32760 tokens) and 512 text tokens.
For the diffusers models, `register_diffusers_backend()` and `set_attention_backend("sage_hub")` against the
default backend, "native" (SDPA). Weights get small random perturbations, since zero-initialized output layers
would hide the attention.

Reported per family: the agreement of the INT8 model and of the bf16 SDPA model with the same model in float32 on
SDPA (output cosine; for the LLM, of the logits on kept tokens, and how often their next-token argmax agrees),
and the bf16 models' forward times (median of CUDA-event timings).
"""

import argparse
import copy
import json
import sys

import torch

from _load import load_package
from example_model import cos_sim, time_forward

LLAMA = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)
PROMPT_LENGTHS = [4096, 3000, 2048, 1024]
FLUX = dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, axes_dims_rope=(16, 56, 56))
FLUX_TOKENS = dict(image=4096, text=512)
WAN = dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
           text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=2, cross_attn_norm=True,
           qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
WAN_LATENT = (16, 21, 60, 104)  # channels, frames, height, width: 81 frames at 480x832
TEXT_TOKENS = 512


def perturbed(model):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval()


def llm(ai8, device, dtype, config=LLAMA, lengths=PROMPT_LENGTHS):
    """(label, runs, compare): Llama models with the same weights on one left-padded batch."""
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register("int8", ai8.transformers_attention)
    AttentionMaskInterface.register("int8", ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])  # the [B, N] mask
    # A config each: _from_config records the attention implementation in the config it is given.
    build = lambda attn, dtype: transformers.LlamaForCausalLM._from_config(  # noqa: E731
        transformers.LlamaConfig(**config), attn_implementation=attn, dtype=dtype).eval()
    with torch.device(device):  # initialized where they run: a CPU init of these weights takes longer than the runs
        models = {"sdpa": perturbed(build("sdpa", dtype)), "int8": build("int8", dtype),
                  "fp32": build("sdpa", torch.float32)}
    for name in ("int8", "fp32"):
        models[name].load_state_dict(models["sdpa"].state_dict())
    longest = max(lengths)
    ids = torch.randint(0, config["vocab_size"], (len(lengths), longest), device=device)
    mask = (torch.arange(longest, device=device) >= longest - torch.tensor(lengths, device=device)[:, None]).long()
    kept = mask.bool()

    def compare(out, reference):
        a, b = out.logits[kept], reference.logits[kept]
        return {"cos": cos_sim(a, b), "argmax_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item()}

    runs = {name: (lambda model=model: model(input_ids=ids, attention_mask=mask)) for name, model in models.items()}
    label = (f"LlamaForCausalLM {config['num_hidden_layers']} layers, hidden {config['hidden_size']} "
             f"({config['num_attention_heads']}/{config['num_key_value_heads']} heads x {config['head_dim']}), "
             f"left-padded prompts {lengths}")
    return label, runs, compare


def diffusers_runs(ai8, model, inputs):
    """Runs of the model under the sage_hub backend (this package's sageattn), under the default one, "native"
    (SDPA; named, since set_attention_backend also sets the process-wide default), and of a float32 copy on SDPA."""
    backend = ai8.layers.register_diffusers_backend()
    model32 = copy.deepcopy(model).float()
    inputs32 = {name: t.float() if t.is_floating_point() else t for name, t in inputs.items()}

    def with_backend(model, name, inputs):
        def run():
            model.set_attention_backend(name)
            return model(**inputs, return_dict=False)[0]
        return run
    return {"int8": with_backend(model, backend, inputs), "sdpa": with_backend(model, "native", inputs),
            "fp32": with_backend(model32, "native", inputs32)}


def flux(ai8, device, dtype, config=FLUX, tokens=FLUX_TOKENS):
    import diffusers

    with torch.device(device):
        model = perturbed(diffusers.FluxTransformer2DModel(**config)).to(dtype)
    n_img, n_txt = tokens["image"], tokens["text"]
    side = int(n_img ** 0.5)
    img_ids = torch.zeros(n_img, 3, device=device)
    img_ids[:, 1] = torch.arange(n_img, device=device) // side
    img_ids[:, 2] = torch.arange(n_img, device=device) % side
    inputs = dict(hidden_states=torch.randn(1, n_img, config["in_channels"], device=device, dtype=dtype),
                  encoder_hidden_states=torch.randn(1, n_txt, config["joint_attention_dim"], device=device,
                                                    dtype=dtype),
                  pooled_projections=torch.randn(1, config["pooled_projection_dim"], device=device, dtype=dtype),
                  timestep=torch.tensor([0.5], device=device, dtype=dtype), img_ids=img_ids,
                  txt_ids=torch.zeros(n_txt, 3, device=device))
    runs = diffusers_runs(ai8, model, inputs)
    label = (f"FluxTransformer2DModel {config['num_layers']} double + {config['num_single_layers']} single blocks, "
             f"{config['num_attention_heads']} heads x {config['attention_head_dim']}, {n_img} image + {n_txt} "
             f"text tokens")
    return label, runs, lambda out, reference: {"cos": cos_sim(out, reference)}


def wan(ai8, device, dtype, config=WAN, latent=WAN_LATENT, text_tokens=TEXT_TOKENS):
    import diffusers

    with torch.device(device):
        model = perturbed(diffusers.WanTransformer3DModel(**config)).to(dtype)
    inputs = dict(hidden_states=torch.randn(1, *latent, device=device, dtype=dtype),
                  timestep=torch.tensor([500], device=device),
                  encoder_hidden_states=torch.randn(1, text_tokens, config["text_dim"], device=device, dtype=dtype))
    runs = diffusers_runs(ai8, model, inputs)
    p = config["patch_size"]
    tokens = latent[1] // p[0] * (latent[2] // p[1]) * (latent[3] // p[2])
    label = (f"WanTransformer3DModel {config['num_layers']} blocks, {config['num_attention_heads']} heads x "
             f"{config['attention_head_dim']}, {tokens} video + {text_tokens} text tokens")
    return label, runs, lambda out, reference: {"cos": cos_sim(out, reference)}


FAMILIES = {"llm": llm, "flux": flux, "wan": wan}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("families", nargs="*", metavar="FAMILY", help=f"of {', '.join(FAMILIES)}; default: all")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", help="append each result as a JSON line to this file")
    args = parser.parse_args()
    if unknown := set(args.families) - set(FAMILIES):
        parser.error(f"unknown FAMILY {', '.join(sorted(unknown))}: expected some of {', '.join(FAMILIES)}")
    if not torch.cuda.is_available():
        print("family_models: no CUDA GPU on this machine; the INT8 kernel needs one")
        return 0
    ai8, loaded_from = load_package()
    torch.set_grad_enabled(False)
    print(f"attention_int8: {loaded_from}\n{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16\n")
    print("| family | model | INT8 vs fp32 SDPA | bf16 SDPA vs fp32 SDPA | SDPA ms | INT8 ms | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for name in args.families or FAMILIES:
        label, runs, compare = FAMILIES[name](ai8, "cuda", torch.bfloat16)
        outs = {method: run() for method, run in runs.items()}
        agreement = {method: compare(outs[method], outs["fp32"]) for method in ("int8", "sdpa")}
        del outs, runs["fp32"]
        ms = {method: time_forward(runs[method], (), args.warmup, args.repeats) for method in ("int8", "sdpa")}
        shown = {method: ", ".join(f"{k} {v:.6f}" for k, v in a.items()) for method, a in agreement.items()}
        print(f"| {name} | {label} | {shown['int8']} | {shown['sdpa']} | {ms['sdpa']:.1f} | {ms['int8']:.1f} | "
              f"{ms['sdpa'] / ms['int8']:.2f}x |", flush=True)
        if args.out:
            with open(args.out, "a") as out_file:
                out_file.write(json.dumps({"family": name, "model": label, "gpu": torch.cuda.get_device_name(),
                                           "torch": torch.__version__, "vs_fp32": agreement, "ms": ms}) + "\n")
        del runs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
