"""A diffusion sampler: diffusers' own DDIM loop with the UNet wrapped in one line.

    pip install diffusers            # or: pip install "graphwrap[diffusion]"
    python examples/diffusion.py

A small Stable-Diffusion-1.x-shaped UNet with random weights (fp16 on a GPU), 30 DDIM steps with
classifier-free guidance (each step one UNet call of 2 rows: unconditioned and conditioned).
``GraphedModule(unet)`` captures the UNet's step once (the timestep is a tensor input: one graph
serves every step) and the scheduler runs as it does in diffusers' pipelines. Prints the time of
a loop eagerly and through graphwrap, and whether the latents equal eager's. On a machine
without CUDA every call runs eagerly (same answers).
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import graphwrap  # noqa: E402

try:
    from diffusers import DDIMScheduler, UNet2DConditionModel
except ImportError:  # diffusers is an optional extra
    DDIMScheduler = UNet2DConditionModel = None

STEPS, GUIDANCE = 30, 7.5


def make_unet() -> "UNet2DConditionModel":
    return UNet2DConditionModel(
        sample_size=32, block_out_channels=(48, 96, 192, 192), layers_per_block=1, norm_num_groups=16,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=256, attention_head_dim=8)


def make_scheduler() -> "DDIMScheduler":
    """Stable Diffusion's DDIM settings."""
    return DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, clip_sample=False,
                         set_alpha_to_one=False, steps_offset=1)


def sample(unet, scheduler, latents, text, **extra):
    """diffusers' sampling loop (as StableDiffusionPipeline runs it), over any callable UNet;
    ``extra``: more inputs of each UNet call (SDXL's ``added_cond_kwargs``)."""
    scheduler.set_timesteps(STEPS, device=latents.device)
    latents = latents * scheduler.init_noise_sigma
    for t in scheduler.timesteps:
        x = scheduler.scale_model_input(torch.cat([latents, latents]), t)
        uncond, cond = unet(x, t, encoder_hidden_states=text, **extra).sample.chunk(2)
        latents = scheduler.step(uncond + GUIDANCE * (cond - uncond), t, latents).prev_sample
    return latents


def main() -> int:
    if UNet2DConditionModel is None:
        print("this example needs diffusers: pip install diffusers")
        return 0
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    unet = make_unet().to(device).eval()
    unet = unet.half() if dtype == torch.float16 else unet
    scheduler = make_scheduler()
    latents = torch.randn(1, 4, 32, 32, device=device, dtype=dtype)
    text = torch.randn(2, 77, 256, device=device, dtype=dtype)  # [unconditioned, conditioned] embeddings

    gm = graphwrap.GraphedModule(unet)  # the one line
    times = {}
    with torch.no_grad():
        for name, fn in (("eager", unet), ("graphwrap", gm)):
            sample(fn, scheduler, latents, text)  # warm-up (graphwrap captures here)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = sample(fn, scheduler, latents, text)
            if device == "cuda":
                torch.cuda.synchronize()
            times[name] = (time.perf_counter() - t0, out)
    (eager_s, ref), (gw_s, got) = times["eager"], times["graphwrap"]
    params = sum(p.numel() for p in unet.parameters()) / 1e6
    print(f"UNet {params:.1f}M parameters, {STEPS} DDIM steps with guidance, {device}: eager {eager_s:.3f} s, "
          f"graphwrap {gw_s:.3f} s ({eager_s / gw_s:.1f}x)")
    print(f"latents equal eager's: {torch.equal(got, ref)} (largest difference {(got - ref).abs().max().item():.3g}); "
          f"steps served eagerly: {sum(gm.stats()['eager_calls'].values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
