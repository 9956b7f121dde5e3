"""The diffusion suite: diffusers' own DDIM sampling loop (``examples/diffusion.py``: 30 steps,
classifier-free guidance, fp16, random weights, one image of 32x32 latents) with the UNet

- eager;
- wrapped in one line, ``GraphedModule(unet)`` (default settings), and with ``compile=True``;
- ``torch.compile(unet, mode="reduce-overhead")``;
- floor: the UNet's step captured by hand in one graph, 30 bare ``graph.replay()`` calls (the
  scheduler's own work left out).

Two shapes: the example's small Stable-Diffusion-1.x UNet, and an SDXL-shaped one (three
levels, two transformer layers deeper down, text-and-time conditioning). Each loop's latents are
compared with eager's. Needs diffusers (left out with the reason where it is missing).
"""

import importlib.util
import os

import torch
from diffusers import UNet2DConditionModel  # the suite is left out where diffusers is missing
from harness import Case

from graphwrap import GraphedModule

_spec = importlib.util.spec_from_file_location(
    "diffusion_example", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples",
                                      "diffusion.py"))
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)  # the example's UNet, scheduler and loop: the suite times what it shows

SCENARIO = "diffusion"


def sdxl_shaped() -> "UNet2DConditionModel":
    return UNet2DConditionModel(
        sample_size=32, block_out_channels=(128, 256, 384), layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 2), cross_attention_dim=512, attention_head_dim=(2, 4, 8),
        addition_embed_type="text_time", addition_time_embed_dim=64, projection_class_embeddings_input_dim=64 * 6 + 512,
        use_linear_projection=True)


SHAPES = {
    "sd1-small": ("small SD-1.x-shaped UNet", example.make_unet, 256, False),
    "sdxl-shaped": ("SDXL-shaped UNet", sdxl_shaped, 512, True),
}


def run(results, device, quick: bool, repeats: int, shapes=tuple(SHAPES)):
    rounds = 3 if quick else 5
    for name in shapes:
        _one(results, device, *SHAPES[name], rounds)
        torch.cuda.empty_cache()


def _one(results, device, label, make, width, added, rounds):
    torch.manual_seed(0)
    unet = make().to(device).eval().half()
    params = sum(p.numel() for p in unet.parameters()) / 1e6
    latents = torch.randn(1, 4, 32, 32, device=device, dtype=torch.float16)
    text = torch.randn(2, 77, width, device=device, dtype=torch.float16)
    extra = {}
    if added:  # SDXL's pooled text embedding and its six size and crop numbers, per row
        extra["added_cond_kwargs"] = {"text_embeds": torch.randn(2, width, device=device, dtype=torch.float16),
                                      "time_ids": torch.tensor([[1024.0, 1024, 0, 0, 1024, 1024]] * 2,
                                                               device=device, dtype=torch.float16)}
    scheduler = example.make_scheduler()

    def loop(fn):
        return lambda: example.sample(fn, scheduler, latents, text, **extra)

    with torch.no_grad():
        ref = loop(unet)()
        gm = GraphedModule(unet)
        gm_compiled = GraphedModule(unet, compile=True)
        compiled = torch.compile(unet, mode="reduce-overhead")
        outs = {}
        case = Case(results, SCENARIO, f"{label} ({params:.1f}M), DDIM {example.STEPS} steps with guidance, fp16")
        for strategy, fn in (("eager", unet), ("GraphedModule(unet), default settings", gm),
                             ("GraphedModule(unet, compile=True)", gm_compiled),
                             ("torch.compile reduce-overhead", compiled)):
            def setup(fn=fn, strategy=strategy):
                def run_loop():
                    outs[strategy] = loop(fn)()
                return run_loop
            case.add(strategy, setup)
        case.add(f"floor: the step captured by hand, {example.STEPS} bare replays", lambda: _bare(unet, latents, text,
                                                                                                   extra))
        case.run(rounds)
        for strategy, out in outs.items():
            diff = (out.float() - ref.float()).abs().max().item()
            results.note(SCENARIO, case.case, f"{strategy}: largest difference from eager's latents", diff, "",
                         equal=bool(torch.equal(out, ref)))
            print(f"  [{case.case}] {strategy}: latents equal eager's {torch.equal(out, ref)}, largest difference "
                  f"{diff:.3g}", flush=True)
        eager_calls = sum(gm.stats()["eager_calls"].values())
        results.note(SCENARIO, case.case, "GraphedModule(unet): UNet calls served eagerly", eager_calls, "")
        print(f"  [{case.case}] GraphedModule(unet): UNet calls served eagerly: {eager_calls}", flush=True)


def _bare(unet, latents, text, extra):
    """One graph of the UNet's step at the loop's shapes, replayed once per step."""
    x = torch.cat([latents, latents])
    t = torch.tensor(500, device=x.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            unet(x, t, encoder_hidden_states=text, **extra)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        unet(x, t, encoder_hidden_states=text, **extra)

    def replays():
        for _ in range(example.STEPS):
            graph.replay()
    return replays
