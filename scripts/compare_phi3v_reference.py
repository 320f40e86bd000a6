#!/usr/bin/env python3
"""Check that ``hkrag.models.phi3v`` reproduces the original Phi-3-vision remote code numerically.

Two steps, two Python environments (the original remote code only runs on transformers 4.x):

``dump`` (project environment, transformers 5.x)
    Builds a Phi3V with the FULL CLIP ViT-L/14-336 vision tower (the reference hard-codes 336 px,
    24x24 patches, 1024 dims) and a small longrope Phi-3 LM, random-initialised with a fixed seed,
    saves it with ``save_pretrained`` and then rewrites ``config.json`` in the ORIGINAL layout (flat LM
    keys, ``img_processor``/``embd_layer`` dicts, ``rope_scaling`` with ``type: su``, no
    ``vision_config``). It reloads the folder with :func:`hkrag.models.phi3v.load_phi3v` (so our
    loading of an original-style checkpoint is exercised), builds inputs with our processor and
    saves inputs, intermediate tensors, last hidden states and logits (fp32) for a few cases.

``compare`` (a transformers 4.x environment holding the reference)
    Imports the reference ``modeling_phi3_v.py`` from ``--reference-code`` (a checkout OUTSIDE this
    repository; nothing of it is copied here), loads the same folder in fp32 with eager attention,
    checks every loaded tensor equals the saved one, runs the same inputs (a copy of ``input_ids``:
    the reference clamps them in place) and reports max abs / rel differences of the image
    projection output, the input embeddings, the last hidden state and the logits. If the reference
    image processor can be imported (it needs torchvision) it also compares ``pixel_values``,
    ``image_sizes`` and ``input_ids`` of the reference processor with ours for the same PNG pages.
    Exits 1 when a difference is above tolerance.

Usage (see docs/phi3v_fidelity.md)::

    python scripts/compare_phi3v_reference.py dump --out /tmp/phi3v_dump
    /tmp/refenv/bin/python scripts/compare_phi3v_reference.py compare \
        --dump /tmp/phi3v_dump --reference-code /tmp/phi3v_ref
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

DEFAULT_TOKENIZER = "/work/shared/reference/phi3v"
DOC_PROMPT = "<|image_1|>\nWhat is shown in this image?<|endoftext|>"
TWO_IMAGE_PROMPT = "<|image_1|>\n<|image_2|>\nWhat is shown in these images?<|endoftext|>"
PAGES = {"page_1000x500": (1000, 500), "page_400x900": (400, 900)}
# name -> (prompt, pages, position offset). An offset >= original_max_position_embeddings (4096)
# makes both implementations switch longrope to the long factors (max(position_ids) + 1 > 4096).
CASES = {
    "doc_landscape": (DOC_PROMPT, ["page_1000x500"], 0),
    "doc_portrait": (DOC_PROMPT, ["page_400x900"], 0),
    "two_images": (TWO_IMAGE_PROMPT, ["page_1000x500", "page_400x900"], 0),
    "doc_landscape_long_rope": (DOC_PROMPT, ["page_1000x500"], 4096),
}
TENSORS = ("image_proj", "inputs_embeds", "hidden", "logits")


def original_style_config(head_dim: int = 64) -> dict:
    """config.json in the layout of microsoft/Phi-3-vision-128k-instruct, with a small LM."""
    half = head_dim // 2
    return {
        "architectures": ["Phi3VForCausalLM"],
        "model_type": "phi3_v",
        "attention_dropout": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "embd_layer": {
            "embedding_cls": "image",
            "hd_transform_order": "sub_glb",
            "projection_cls": "mlp",
            "use_hd_transform": True,
            "with_learnable_separator": True,
        },
        "img_processor": {
            "image_dim_out": 1024,
            "model_name": "openai/clip-vit-large-patch14-336",
            "name": "clip_vision_model",
            "num_img_tokens": 144,
        },
        "hidden_act": "silu",
        "hidden_size": 4 * head_dim,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "initializer_range": 0.02,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "su",
            "short_factor": [round(1.0 + 2.0 * i / (half - 1), 6) for i in range(half)],
            "long_factor": [round(1.0 + 63.0 * (i / (half - 1)) ** 2, 6) for i in range(half)],
        },
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": 32064,
    }


def random_page(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8), mode="RGB")


def diff_stats(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    ours, ref = ours.double(), ref.double()
    abs_diff = (ours - ref).abs()
    return {
        "max_abs": float(abs_diff.max()),
        "max_rel": float((abs_diff / ref.abs().clamp(min=1e-6)).max()),
        "max_abs_over_max_ref": float(abs_diff.max() / ref.abs().max().clamp(min=1e-12)),
        "ref_max_abs_value": float(ref.abs().max()),
    }


def capture(module: torch.nn.Module, store: dict, key: str):
    """Forward hook keeping the module's (last) output."""

    def hook(_module, _inputs, output):
        store[key] = (output[0] if isinstance(output, tuple) else output).detach().clone()

    return module.register_forward_hook(hook)


# ----------------------------------------------------------------------------------------- dump


def dump(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from hkrag.models.phi3v import Phi3VConfig, Phi3VForCausalLM, load_phi3v, load_processor

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    ckpt = out / "checkpoint"
    ckpt.mkdir(parents=True, exist_ok=True)
    original = original_style_config()

    # 1. random init from the original-style dict, fixed seed, every parameter non-trivial
    torch.manual_seed(args.seed)
    config = Phi3VConfig(**original)
    config._attn_implementation = "eager"
    model = Phi3VForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("glb_GN", "sub_GN")):
                param.normal_(0.0, 1.0)
            elif "norm" in name or "layrnorm" in name:  # LayerNorm / RMSNorm: not all ones / zeros
                param.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
            elif name.endswith("bias"):
                param.normal_(0.0, 0.02)
    model.save_pretrained(ckpt, safe_serialization=True)
    (ckpt / "config.json").write_text(json.dumps(original, indent=2))  # the ORIGINAL layout, not ours
    saved_state = {k: v.clone() for k, v in model.state_dict().items()}
    del model

    # 2. reload through our public loader from the original-style config.json
    model = load_phi3v(str(ckpt), dtype=torch.float32, attn_implementation=args.attn).eval()
    reloaded = model.state_dict()
    mismatched = [k for k in saved_state if k not in reloaded or not torch.equal(saved_state[k], reloaded[k])]
    if mismatched or set(reloaded) - set(saved_state):
        print(f"reload mismatch: {mismatched[:5]} extra {sorted(set(reloaded) - set(saved_state))[:5]}")
        return 1
    print(f"checkpoint: {ckpt} ({len(saved_state)} tensors, reload via load_phi3v bit-exact)")

    # 3. inputs from our processor
    processor = load_processor(args.tokenizer, num_crops=args.num_crops)
    for i, (name, (w, h)) in enumerate(PAGES.items()):
        random_page(w, h, seed=args.seed + 1 + i).save(out / f"{name}.png")
    from PIL import Image

    manifest = {
        "tokenizer": str(Path(args.tokenizer).resolve()),
        "num_crops": args.num_crops,
        "seed": args.seed,
        "our_attn_implementation": args.attn,
        "our_versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "cases": {},
    }
    hidden_store: dict = {}
    capture(model.model.norm, hidden_store, "hidden")
    capture(model.model.vision_embed_tokens.img_projection, hidden_store, "image_proj")
    capture(model.model.embed_dropout, hidden_store, "inputs_embeds")
    for case, (prompt, pages, offset) in CASES.items():
        images = [Image.open(out / f"{p}.png").convert("RGB") for p in pages]
        batch = processor(prompt, images)
        input_ids = batch["input_ids"]
        length = input_ids.shape[1]
        position_ids = torch.arange(offset, offset + length).unsqueeze(0)
        kwargs = {"position_ids": position_ids} if offset else {}
        ids_before = input_ids.clone()
        start = time.time()
        with torch.no_grad():
            logits = model(
                input_ids=input_ids,
                pixel_values=batch["pixel_values"],
                image_sizes=batch["image_sizes"],
                attention_mask=batch["attention_mask"],
                use_cache=False,
                **kwargs,
            ).logits
        if not torch.equal(ids_before, input_ids):
            print("our model modified input_ids in place")
            return 1
        tensors = {
            "input_ids": input_ids,
            "attention_mask": batch["attention_mask"],
            "pixel_values": batch["pixel_values"].float().contiguous(),
            "image_sizes": batch["image_sizes"],
            "position_ids": position_ids,
            "logits": logits.float().contiguous(),
            **{k: hidden_store[k].float().contiguous() for k in ("hidden", "image_proj", "inputs_embeds")},
        }
        save_file(tensors, str(out / f"{case}.safetensors"))
        manifest["cases"][case] = {
            "prompt": prompt,
            "pages": pages,
            "position_offset": offset,
            "seq_len": length,
            "image_tokens": int((input_ids < 0).sum()),
            "image_sizes": batch["image_sizes"].tolist(),
        }
        print(
            f"{case}: seq_len={length} image_tokens={int((input_ids < 0).sum())} "
            f"image_sizes={batch['image_sizes'].tolist()} ({time.time() - start:.0f}s)"
        )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    print(f"dump written to {out}")
    return 0


# -------------------------------------------------------------------------------------- compare


def import_reference(path: Path):
    """Import the reference files as a package ``phi3v_reference`` (they use relative imports)."""
    if not (path / "modeling_phi3_v.py").is_file():
        raise SystemExit(f"{path} has no modeling_phi3_v.py")
    spec = importlib.machinery.ModuleSpec("phi3v_reference", None, is_package=True)
    spec.submodule_search_locations = [str(path)]
    package = importlib.util.module_from_spec(spec)
    sys.modules["phi3v_reference"] = package
    return importlib.import_module("phi3v_reference.modeling_phi3_v")


def import_torchvision_without_ops() -> bool:
    """Import torchvision even when its compiled ops cannot load (PyPI wheels are CUDA builds).

    The reference image processor only uses PIL-level ``resize``/``pad`` and ``ToTensor``/
    ``Normalize`` (pure Python); what fails is registering fake kernels for missing ops such as
    ``torchvision::nms``. Those registrations are skipped in memory; no file is changed.
    """
    try:
        import torchvision  # noqa: F401

        return True
    except Exception:  # noqa: BLE001
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    original = torch.library.register_fake

    def register_fake(op, *args, **kwargs):
        if isinstance(op, str) and op.startswith("torchvision::"):
            return lambda fn=None, **_: fn
        return original(op, *args, **kwargs)

    torch.library.register_fake = register_fake
    try:
        import torchvision  # noqa: F401

        print("note: torchvision imported with its compiled ops disabled (fake-kernel registration skipped)")
        return True
    except Exception as exc:  # noqa: BLE001
        print(f"torchvision unavailable ({exc!r}): image-processor comparison skipped")
        return False
    finally:
        torch.library.register_fake = original


def compare_processor(dump_dir: Path, manifest: dict, failures: list[str]) -> None:
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    if not import_torchvision_without_ops():
        return
    ref_image = importlib.import_module("phi3v_reference.image_processing_phi3_v")
    ref_proc = importlib.import_module("phi3v_reference.processing_phi3_v")
    tokenizer = AutoTokenizer.from_pretrained(manifest["tokenizer"])
    processor = ref_proc.Phi3VProcessor(
        # num_img_tokens=144 is what the original preprocessor_config.json passes as a kwarg
        image_processor=ref_image.Phi3VImageProcessor(num_crops=manifest["num_crops"], num_img_tokens=144),
        tokenizer=tokenizer,
    )
    print(f"\n== processor (reference tokenizer class {type(tokenizer).__name__}) ==")
    for case, info in manifest["cases"].items():
        ours = load_file(str(dump_dir / f"{case}.safetensors"))
        images = [Image.open(dump_dir / f"{p}.png").convert("RGB") for p in info["pages"]]
        ref = processor(info["prompt"], images, return_tensors="pt")
        ids_equal = torch.equal(ref["input_ids"], ours["input_ids"])
        ref_sizes = torch.as_tensor(ref["image_sizes"]).long()
        sizes_equal = torch.equal(ref_sizes, ours["image_sizes"])
        same_shape = tuple(ref["pixel_values"].shape) == tuple(ours["pixel_values"].shape)
        pix = diff_stats(ours["pixel_values"], ref["pixel_values"].float())["max_abs"] if same_shape else float("inf")
        print(
            f"{case:26s} input_ids equal={ids_equal} (len {ref['input_ids'].shape[1]} vs "
            f"{ours['input_ids'].shape[1]})  image_sizes equal={sizes_equal} {ref_sizes.tolist()}  "
            f"pixel_values shape {tuple(ref['pixel_values'].shape)} max_abs={pix:.3g}"
        )
        if not (ids_equal and sizes_equal and pix <= 1e-5):
            failures.append(f"processor/{case}")


def compare(args: argparse.Namespace) -> int:
    import transformers
    from safetensors.torch import load_file

    torch.set_num_threads(args.threads)
    dump_dir = Path(args.dump)
    manifest = json.loads((dump_dir / "manifest.json").read_text())
    modeling = import_reference(Path(args.reference_code).resolve())
    print(
        f"reference: torch {torch.__version__}, transformers {transformers.__version__}; "
        f"ours (dump): {manifest['our_versions']}"
    )

    ckpt = dump_dir / "checkpoint"
    config = modeling.Phi3VConfig.from_pretrained(ckpt)
    model = modeling.Phi3VForCausalLM.from_pretrained(
        ckpt, config=config, torch_dtype=torch.float32, attn_implementation="eager"
    ).eval()
    print(
        f"reference attn_implementation={model.config._attn_implementation}, "
        f"rotary={type(model.model.layers[0].self_attn.rotary_emb).__name__}"
    )

    # every tensor the reference holds must equal the saved one (names = original layout)
    saved = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    ref_state = model.state_dict()
    aliases = {"model.vision_embed_tokens.wte.weight": "model.embed_tokens.weight"}  # same module twice
    missing = [k for k in ref_state if aliases.get(k, k) not in saved]
    unexpected = [k for k in saved if k not in ref_state]
    unequal = [
        k for k in ref_state if aliases.get(k, k) in saved and not torch.equal(ref_state[k], saved[aliases.get(k, k)])
    ]
    print(
        f"weights: {len(saved)} saved tensors, reference holds {len(ref_state)}; "
        f"missing={missing} unexpected={unexpected} unequal={unequal}"
    )
    failures: list[str] = []
    if missing or unexpected or unequal:
        failures.append("weights")

    if args.skip_model:
        cases = {}
    else:
        cases = manifest["cases"]
    store: dict = {}
    capture(model.model.vision_embed_tokens.img_projection, store, "image_proj")
    capture(model.model.vision_embed_tokens, store, "inputs_embeds")
    tolerances = {"image_proj": args.atol, "inputs_embeds": args.atol, "hidden": args.atol, "logits": args.atol}
    results = {}
    print(
        f"\n== model (ours transformers-5 {manifest.get('our_attn_implementation', 'eager')} "
        "vs reference remote code eager, fp32) =="
    )
    for case, info in cases.items():
        data = load_file(str(dump_dir / f"{case}.safetensors"))
        input_ids = data["input_ids"].clone()  # the reference clamps input_ids in place
        kwargs = {"position_ids": data["position_ids"]} if info["position_offset"] else {}
        start = time.time()
        with torch.no_grad():
            out = model(
                input_ids=input_ids,
                attention_mask=data["attention_mask"],
                pixel_values=data["pixel_values"],
                image_sizes=data["image_sizes"],
                use_cache=False,
                output_hidden_states=True,
                return_dict=True,
                **kwargs,
            )
        ref = {"hidden": out.hidden_states[-1], "logits": out.logits, **store}
        results[case] = {k: diff_stats(data[k], ref[k].float()) for k in TENSORS}
        print(
            f"{case} (seq_len {info['seq_len']}, image tokens {info['image_tokens']}, "
            f"position offset {info['position_offset']}, {time.time() - start:.0f}s)"
        )
        for k in TENSORS:
            s = results[case][k]
            ok = s["max_abs"] <= tolerances[k]
            print(
                f"  {k:14s} max_abs={s['max_abs']:.3e}  max_abs/max|ref|={s['max_abs_over_max_ref']:.3e}  "
                f"max_rel={s['max_rel']:.3e}  (max|ref|={s['ref_max_abs_value']:.3g})  {'ok' if ok else 'FAIL'}"
            )
            if not ok:
                failures.append(f"{case}/{k}")
        argmax_equal = bool(torch.equal(data["logits"].argmax(-1), ref["logits"].argmax(-1)))
        print(f"  argmax(logits) identical at every position: {argmax_equal}")

    if "doc_landscape" in results and "doc_landscape_long_rope" in results:
        # RoPE scores depend only on relative positions, so with the SAME factors the +4096 offset
        # would change almost nothing; a large change shows the long factors were really selected.
        a = load_file(str(dump_dir / "doc_landscape.safetensors"))["hidden"]
        b = load_file(str(dump_dir / "doc_landscape_long_rope.safetensors"))["hidden"]
        print(
            f"sanity: ours, hidden(offset 4096) vs hidden(offset 0) max_abs={float((a - b).abs().max()):.3e} "
            "(large => long factors in use in both implementations)"
        )
    if not args.skip_processor:
        compare_processor(dump_dir, manifest, failures)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\n{'FAIL: ' + ', '.join(failures) if failures else 'PASS'} (atol {args.atol})")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("dump", help="project env: build, save and run our model")
    d.add_argument("--out", required=True)
    d.add_argument("--tokenizer", default=DEFAULT_TOKENIZER)
    d.add_argument("--num-crops", type=int, default=4)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--threads", type=int, default=2)
    d.add_argument("--attn", default="eager", help="our attention implementation (eager, sdpa)")
    c = sub.add_parser("compare", help="reference env: run the original remote code on the dump")
    c.add_argument("--dump", required=True)
    c.add_argument("--reference-code", required=True, help="folder holding the reference modeling_phi3_v.py etc.")
    c.add_argument("--atol", type=float, default=1e-4)
    c.add_argument("--skip-processor", action="store_true")
    c.add_argument("--skip-model", action="store_true", help="only compare the processors")
    c.add_argument("--json", help="also write the measured differences here")
    c.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    return dump(args) if args.command == "dump" else compare(args)


if __name__ == "__main__":
    sys.exit(main())
