"""HKRAG-Ret: the Phi3V dual encoder (paper §3.2, docs/training.md).

One model embeds queries and document pages. A document is the prompt ``<|image_1|>\\nWhat is shown in
this image?`` with its page, a query is the dataset's query text; both end with the tokenizer's EOS
(``hkrag.data.collators``: the single convention used by training, encoding and the demo). The
embedding is the base model's final hidden state at the last real token (padding-side safe),
L2-normalised; no LM-head logits and no attention maps are computed.

LoRA (peft) wraps :class:`Phi3VForCausalLM`, so adapter keys are ``base_model.model.model.layers...``
exactly as the VDocRAG adapters were saved and they load unchanged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict, load_peft_weights, set_additional_trainable_modules
from PIL import Image
from safetensors import SafetensorError
from torch import nn
from tqdm.auto import tqdm
from transformers import BatchFeature

from hkrag.data.collators import RetrieverCollator
from hkrag.io import read_json
from hkrag.late_interaction import (
    DEFAULT_DIM,
    HEADS,
    PROJECTION,
    QUERY_AUGMENTATION,
    make_projection,
    project_tokens,
    unpad,
)
from hkrag.losses import causal_lm_loss
from hkrag.models.phi3v import Phi3VForCausalLM, Phi3VModel, Phi3VProcessor
from hkrag.models.phi3v.loading import (
    PHI3V_HUB_ID,
    CheckpointNotFoundError,
    load_phi3v,
    load_processor,
    save_processor,
    tiny_phi3v,
    verify_shipped,
)
from hkrag.models.phi3v.modeling_phi3v import Phi3VImageEmbedding

logger = logging.getLogger(__name__)

PHI3_LORA_TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""Our choice (``model/lora=phi3_fused``): every linear layer of the language model, whose attention and MLP input
projections Phi-3 fuses (``qkv_proj``, ``gate_up_proj``); the vision tower is left as it is."""
VDOCRAG_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "up_proj", "gate_proj")
"""VDocRAG's ``--lora_target_modules`` (every training command of github.com/nttmdlab-nlp/VDocRAG's README, and
their arguments' default; ``model/lora=vdocrag``). peft matches a name by suffix, so on Phi3V this trains the CLIP
tower's attention ``q_proj``, ``k_proj`` and ``v_proj`` and the language model's ``o_proj`` and ``down_proj``:
Phi-3 has no ``up_proj`` or ``gate_proj`` (fused into ``gate_up_proj``) nor separate ``q/k/v`` (``qkv_proj``).
Their released adapters were trained on exactly that set."""


def lora_modules(model: nn.Module) -> list[str]:
    """The full names of the modules a LoRA adapter wraps in ``model`` (peft's LoRA layers), in module order."""
    return [name for name, module in model.named_modules() if isinstance(module, LoraLayer)]


def describe_lora_modules(names: Sequence[str]) -> str:
    """``names`` grouped by pattern with layer indices as ``*``: ``"model.layers.*.self_attn.o_proj (32), ..."``."""
    groups: dict[str, int] = {}
    for name in names:
        pattern = re.sub(r"\.\d+(?=\.|$)", ".*", name.removeprefix("base_model.model."))
        groups[pattern] = groups.get(pattern, 0) + 1
    return ", ".join(f"{pattern} ({count})" for pattern, count in groups.items()) or "none"


def log_lora_modules(model: nn.Module) -> list[str]:
    """Log which modules LoRA matched (at start-up, so a target list that matches nothing, or something else than
    meant, shows at once); returns their names."""
    names = lora_modules(model)
    logger.info("LoRA wraps %d modules: %s", len(names), describe_lora_modules(names))
    return names


def last_token_pool(hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Hidden state of the last real token of each row, whichever side the padding is on."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (attention_mask.long() * positions).argmax(dim=1)
    return hidden_states[torch.arange(hidden_states.shape[0], device=hidden_states.device), last]


@dataclass(frozen=True)
class HeadSettings:
    """The embedding head (config keys ``model.head`` and ``model.late_interaction``): ``dense`` (one EOS vector,
    the paper's) or ``late_interaction`` (ColPali: a ``dim``-d projection of every token, MaxSim scoring, with
    ``query_augmentation`` EOS tokens after each query)."""

    head: str = "dense"
    dim: int = DEFAULT_DIM
    query_augmentation: int = QUERY_AUGMENTATION
    seed: int = 0

    def __post_init__(self) -> None:
        if self.head not in HEADS:
            raise ValueError(f"model.head must be one of {list(HEADS)}, got {self.head!r}")
        for name in ("dim", "query_augmentation", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "dim" else 0):
                raise ValueError(f"model.late_interaction.{name} must be an integer >= {int(name == 'dim')}, "
                                 f"got {value!r}")

    @property
    def late_interaction(self) -> bool:
        return self.head == HEADS[1]

    @classmethod
    def of(cls, model_cfg: Mapping[str, Any]) -> HeadSettings:
        """``model.head`` and ``model.late_interaction`` of a model config (dense when it has neither)."""
        late = model_cfg.get("late_interaction") or {}
        return cls(head=model_cfg.get("head", "dense"), **{k: late[k] for k in ("dim", "query_augmentation")
                                                           if k in late})


def attach_head(model: Phi3VForCausalLM, head: HeadSettings) -> None:
    """Give ``model`` the untrained ColPali projection (seeded, in the model's dtype and device) as
    ``custom_text_proj``, before any adapter: a saved adapter then loads its trained copy over it."""
    weight = model.get_input_embeddings().weight
    projection = make_projection(model.config.hidden_size, head.dim, head.seed).to(weight.device, weight.dtype)
    projection.requires_grad_(False)
    model.add_module(PROJECTION, projection)
    model.query_augmentation = head.query_augmentation


def adapter_has_head(model: PeftModel) -> bool:
    """Whether the loaded adapter holds a trained projection (``custom_text_proj`` among its saved modules)."""
    return PROJECTION in (model.peft_config["default"].modules_to_save or [])


def saved_head(adapter: str | Path) -> bool | None:
    """Whether the adapter folder's ``adapter_config.json`` saves the projection; ``None`` when it cannot be read
    here (a hub id, a broken file: :func:`load_adapter` reports those)."""
    try:
        config = read_json(Path(adapter) / "adapter_config.json")
    except (OSError, ValueError):
        return None
    return PROJECTION in (config.get("modules_to_save") or []) if isinstance(config, dict) else None


def check_head(adapter: str | Path, head: HeadSettings | None, trainable: bool) -> None:
    """The adapter and ``model.head`` agree, else :class:`AdapterMismatchError` says which head to use: a dense
    head takes no adapter with a projection; the late-interaction head takes one with a trained projection, or a
    dense one when ``trainable`` (a warm start: the projection is added, :func:`train_head`)."""
    late = head is not None and head.late_interaction
    has_head = saved_head(adapter)
    if has_head and not late:
        raise AdapterMismatchError(f"the adapter {str(adapter)!r} was trained with the late-interaction head (it holds "
                                   f"{PROJECTION}): evaluate it with model.head=late_interaction")
    if late and has_head is False and not trainable:
        raise AdapterMismatchError(
            f"the adapter {str(adapter)!r} has no late-interaction projection ({PROJECTION}): it was trained with "
            "model.head=dense; evaluate it with model.head=dense, or train a late-interaction head from it")


def train_head(model: PeftModel) -> None:
    """Add the projection to the adapter's ``modules_to_save`` (trainable, saved with the adapter from now on)."""
    config = model.peft_config["default"]
    config.modules_to_save = [*(config.modules_to_save or []), PROJECTION]
    only_new = SimpleNamespace(modules_to_save=[PROJECTION], inference_mode=False)  # the others keep their copies
    set_additional_trainable_modules(model, only_new, model.config, "default")


@dataclass
class LoraSettings:
    """LoRA hyper-parameters (config group ``model.lora``)."""

    r: int = 8
    alpha: int = 64
    dropout: float = 0.1
    target_modules: Sequence[str] = PHI3_LORA_TARGETS
    modules_to_save: Sequence[str] = field(default_factory=tuple)

    def peft_config(self) -> LoraConfig:
        return LoraConfig(
            task_type=TaskType.FEATURE_EXTRACTION,
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            modules_to_save=list(self.modules_to_save) or None,
        )


class Phi3VRetriever(nn.Module):
    """Dual encoder over a (possibly LoRA-wrapped) :class:`Phi3VForCausalLM`.

    Args:
        model: the causal LM, bare or wrapped by peft; only its base model runs.
        processor: tokenizer + HD image processor.
    """

    def __init__(self, model: Phi3VForCausalLM | PeftModel, processor: Phi3VProcessor) -> None:
        super().__init__()
        self.model = model
        self.processor = processor
        context = getattr(self.backbone.config, "max_position_embeddings", None)
        self.collator = RetrieverCollator(processor, max_query_length=context)
        if self.late_interaction:
            self.collator.query_augmentation = getattr(self.causal_lm, "query_augmentation", QUERY_AUGMENTATION)

    @property
    def causal_lm(self) -> Phi3VForCausalLM:
        """The causal LM under the peft wrapper (if any)."""
        return self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model

    @property
    def late_interaction(self) -> bool:
        """Whether this retriever embeds one projected vector per token (``model.head=late_interaction``)."""
        return hasattr(self.causal_lm, PROJECTION)

    @property
    def head(self) -> str:
        return HEADS[1] if self.late_interaction else HEADS[0]

    @property
    def backbone(self) -> Phi3VModel:
        """The base Phi3VModel (LoRA layers, if any, are injected in place)."""
        return self.causal_lm.model

    @property
    def device(self) -> torch.device:
        return self.backbone.embed_tokens.weight.device

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        """Embeddings (B, hidden) in float32, L2-normalised, from a processor batch; under the late-interaction
        head (B, L, dim) token vectors, each L2-normalised, the padding rows zero (:mod:`hkrag.late_interaction`).

        A batch with ``labels`` (VDocRAG pre-training's RCG batch) gives :meth:`generation_loss` instead, so
        both passes go through the (possibly DDP-wrapped) module call.
        """
        if "labels" in inputs:
            return self.generation_loss(**inputs)
        outputs = self.backbone(**inputs, use_cache=False)
        if self.late_interaction:
            projection = getattr(self.causal_lm, PROJECTION)
            return project_tokens(projection, outputs.last_hidden_state, inputs["attention_mask"])
        pooled = last_token_pool(outputs.last_hidden_state, inputs["attention_mask"])
        return F.normalize(pooled.float(), dim=-1)

    def generation_loss(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        **vision: torch.Tensor,
    ) -> torch.Tensor:
        """Per-example causal-LM loss (B,) through the LM head under a custom 4-D mask (VDocRAG's RCG).

        ``attention_mask`` is ``(B, 1, L, L)`` bool, ``True`` = may attend
        (:func:`hkrag.data.collators.generation_mask`); it becomes an additive float mask in the model's
        dtype, which transformers 5.x passes to the eager and SDPA kernels as is. FlashAttention-2 takes no
        custom mask, hence a ``ValueError``.
        """
        kernel = self.backbone.config._attn_implementation
        if kernel == "flash_attention_2":
            raise ValueError(
                "RCG needs a custom 4-D attention mask, which FlashAttention-2 cannot take: load the model with "
                "model.attn_implementation=eager (VDocRAG's setting) or sdpa"
            )
        if attention_mask.dim() != 4 or attention_mask.dtype != torch.bool:
            raise ValueError(f"generation_loss needs a (B, 1, L, L) bool mask, got {attention_mask.dtype} "
                             f"{tuple(attention_mask.shape)}")
        dtype = self.backbone.embed_tokens.weight.dtype
        additive = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device)
        additive = additive.masked_fill(~attention_mask, torch.finfo(dtype).min)
        lm = self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model
        logits = lm(input_ids=input_ids, attention_mask=additive, position_ids=position_ids, use_cache=False,
                    **vision).logits
        return causal_lm_loss(logits, labels)

    def query_inputs(self, texts: Sequence[str], ids: Sequence[str] | None = None) -> BatchFeature:
        """Processor batch for raw query texts (over-long ones truncated to the context, with a warning)."""
        return self.collator.queries(texts, ids)

    def document_inputs(self, images: Sequence[Image.Image]) -> BatchFeature:
        """Processor batch for document pages, one page per document."""
        return self.collator.documents(images)

    @torch.no_grad()
    def encode_queries(
        self, texts: Sequence[str], batch_size: int = 32, progress: bool = False, ids: Sequence[str] | None = None
    ) -> torch.Tensor | list[torch.Tensor]:
        """Query embeddings (late interaction: one ``(tokens, dim)`` tensor per query); ``ids`` (one per text) name a
        query in warnings. Queries cut to the model's context are
        counted in one warning per call (the first one cut is also named, :class:`RetrieverCollator`)."""
        before = self.collator.truncated
        if ids is None:
            embeddings = self._encode(texts, self.query_inputs, batch_size, progress)
        else:
            pairs = list(zip(texts, ids, strict=True))
            embeddings = self._encode(pairs, lambda chunk: self.query_inputs(*zip(*chunk)), batch_size, progress)
        if cut := self.collator.truncated - before:
            logger.warning("%d of %d queries were longer than the model's context of %d tokens and were cut to it",
                           cut, len(texts), self.collator.max_query_length)
        return embeddings

    @torch.no_grad()
    def encode_documents(
        self, images: Sequence[Image.Image], batch_size: int = 8, progress: bool = False
    ) -> torch.Tensor | list[torch.Tensor]:
        """Page embeddings ``(n, hidden)``; under the late-interaction head one ``(tokens, dim)`` tensor per page."""
        return self._encode(images, self.document_inputs, batch_size, progress)

    def _encode(self, items, make_inputs, batch_size: int, progress: bool) -> torch.Tensor | list[torch.Tensor]:
        chunks = [items[i : i + batch_size] for i in range(0, len(items), batch_size)]
        out = [self(**make_inputs(chunk).to(self.device)).cpu() for chunk in tqdm(chunks, disable=not progress)]
        if self.late_interaction:
            return [tokens for chunk in out for tokens in unpad(chunk)]
        return torch.cat(out) if out else torch.empty(0, self.backbone.config.hidden_size)

    def save(self, directory: str | Path) -> None:
        """Save the LoRA adapter (or the full model when there is none) and the processor."""
        self.model.save_pretrained(directory)
        save_processor(self.processor, directory)

    @classmethod
    def from_pretrained(
        cls,
        base: str = PHI3V_HUB_ID,
        adapter: str | None = None,
        lora: LoraSettings | None = None,
        trainable: bool = False,
        num_crops: int | None = None,
        dtype: torch.dtype | str = torch.bfloat16,
        attn_implementation: str | None = None,
        gradient_checkpointing: bool = False,
        head: HeadSettings | None = None,
        **kwargs: Any,
    ) -> Phi3VRetriever:
        """Base checkpoint + optional existing adapter (e.g. VDocRAG's) + optional new LoRA.

        ``adapter`` loads an existing adapter (trainable when ``trainable``); otherwise ``lora`` adds a
        fresh one. ``num_crops=None`` keeps the checkpoint's value (16 for Phi-3-vision), as VDocRAG's drivers do
        (they load the processor without ``num_crops``).
        """
        model = load_phi3v(base, dtype=dtype, attn_implementation=attn_implementation, **kwargs)
        return cls.wrap(model, load_processor(base, num_crops), adapter, lora, trainable, gradient_checkpointing, head)

    @classmethod
    def tiny(
        cls,
        lora: LoraSettings | None = None,
        num_crops: int = 4,
        seed: int = 0,
        texts: Sequence[str] = (),
        head: HeadSettings | None = None,
        **config_overrides: Any,
    ) -> Phi3VRetriever:
        """A random-initialised tiny retriever with an offline tokenizer (tests, demo, CPU bench)."""
        model, processor = tiny_phi3v(texts=texts, num_crops=num_crops, seed=seed, **config_overrides)
        return cls.wrap(model, processor, lora=lora, trainable=lora is not None, head=head)

    @classmethod
    def wrap(
        cls,
        model: Phi3VForCausalLM,
        processor: Phi3VProcessor,
        adapter: str | Path | None = None,
        lora: LoraSettings | None = None,
        trainable: bool = False,
        gradient_checkpointing: bool = False,
        head: HeadSettings | None = None,
    ) -> Phi3VRetriever:
        """Attach an existing adapter or a new LoRA to ``model`` and freeze everything else.

        ``head`` (late interaction) first gives ``model`` the ColPali projection (:func:`attach_head`), which a
        new LoRA trains and saves (``modules_to_save``); an adapter trained with it brings its weights, one trained
        without it (a dense warm start) gets it added when ``trainable`` (:func:`train_head`). A dense head refuses
        an adapter holding a projection and the late-interaction one refuses to evaluate an adapter without one.
        """
        if head is not None and head.late_interaction:
            attach_head(model, head)
            if lora is not None:
                lora = replace(lora, modules_to_save=(*lora.modules_to_save, PROJECTION))
        if adapter is not None:
            check_head(adapter, head, trainable)
            model = load_adapter(model, adapter, trainable)
            if head is not None and head.late_interaction and not adapter_has_head(model):
                train_head(model)
        elif lora is not None:
            model = get_peft_model(model, lora.peft_config())
        else:
            model.requires_grad_(trainable)
        if gradient_checkpointing:  # after peft, which hooks the inputs of a model already checkpointing
            enable_checkpointing(model)
        freeze_unreachable(model)
        if isinstance(model, PeftModel):
            log_lora_modules(model)
        return cls(model, processor)


def freeze_unreachable(model: nn.Module) -> None:
    """Freeze every image embedding's parameters that no output depends on (a trained ``vision_embed_tokens``
    copy included): they would get no gradient, and DDP stops on trainable parameters without one."""
    for module in model.modules():
        if isinstance(module, Phi3VImageEmbedding):
            for parameter in module.unreachable_parameters():
                parameter.requires_grad_(False)


class AdapterMismatchError(CheckpointNotFoundError):
    """A saved adapter made for another model: another hidden size, layer count or module names."""


SIZE_MISMATCH = re.compile(r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[[^\]]*\])\) from "
                           r"checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")
"""peft's (torch's) message for one adapter tensor whose shape differs from the model's."""


def load_adapter(model: Phi3VForCausalLM, adapter: str | Path, trainable: bool = False) -> PeftModel:
    """A saved peft adapter (hub id or folder) on ``model``; failures name the adapter and the bad file.

    An adapter made for another model is refused (:class:`AdapterMismatchError`, naming the tensors and
    their shapes) rather than loaded in part: peft raises a raw ``RuntimeError`` for another hidden size and
    only warns when layers or module names differ, leaving those LoRA weights fresh or dropping them. A
    shipped adapter whose files no longer match its manifest is refused (:func:`verify_shipped`).
    """
    verify_shipped(adapter)
    try:
        with warnings.catch_warnings():  # check_adapter_keys refuses what peft would only warn about
            warnings.filterwarnings("ignore", message="Found missing adapter keys")
            loaded = PeftModel.from_pretrained(model, str(adapter), is_trainable=trainable)
    except RuntimeError as error:
        mismatched = SIZE_MISMATCH.findall(str(error))
        if not mismatched:
            raise
        name, saved, now = mismatched[0]
        raise AdapterMismatchError(
            f"the adapter {str(adapter)!r} was made for a model of another size (or its adapter_config.json does not "
            f"describe its weights): {len(mismatched)} tensor(s) have "
            f"other shapes, e.g. {name} {saved} in the adapter vs {now} in this model (hidden_size="
            f"{model.config.hidden_size}); {_ADAPTER_ADVICE}"
        ) from error
    except (OSError, ValueError, KeyError, SafetensorError) as error:
        folder = Path(adapter)
        if isinstance(error, SafetensorError):
            where = next((str(p) for p in sorted(folder.glob("adapter_model*.safetensors"))), str(adapter))
            reason = f"{where} is truncated or corrupt ({error})"
        elif isinstance(error, json.JSONDecodeError):
            reason = f"{folder / 'adapter_config.json'} is not valid JSON ({error})"
        else:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointNotFoundError(
            f"could not load the adapter {str(adapter)!r}: {reason}\nGive model.adapter a folder holding "
            "adapter_config.json and adapter_model.safetensors (re-save or re-download it), or model.adapter=null."
        ) from error
    check_adapter_keys(loaded, adapter)
    return loaded


_ADAPTER_ADVICE = ("load it on the base it was trained on (its run's model.base / model.config), or train a new "
                   "adapter for this model")


def check_adapter_keys(model: PeftModel, adapter: str | Path) -> None:
    """Every weight of ``adapter`` has its place in ``model`` and every LoRA layer of ``model`` has its weight,
    else :class:`AdapterMismatchError` naming the adapter, the counts and examples of each side."""
    saved = set(load_peft_weights(str(adapter), device="cpu"))
    expected = set(get_peft_model_state_dict(model))
    unused, fresh = sorted(saved - expected), sorted(expected - saved)
    if unused or fresh:
        parts = [f"{len(unused)} of its {len(saved)} tensor(s) have no place in this model (e.g. {unused[:2]})"
                 if unused else "",
                 f"{len(fresh)} LoRA tensor(s) of this model have no weight in it (e.g. {fresh[:2]})" if fresh else ""]
        targets = sorted(model.peft_config["default"].target_modules or [])
        raise AdapterMismatchError(
            f"the adapter {str(adapter)!r} does not fit this model ({model.config.num_hidden_layers} layers, "
            f"target_modules {targets}): {'; '.join(p for p in parts if p)}; {_ADAPTER_ADVICE}"
        )


def weights_fingerprint(module: nn.Module, samples: int = 1024, frozen_only: bool = False) -> str:
    """A short hash of ``samples`` evenly spaced values of every parameter tensor (names, shapes included).

    Identifies the weights an embedding was computed with (another seed, checkpoint or adapter gives
    another fingerprint) in milliseconds, without hashing gigabytes; a change confined to values off
    the sample grid of every tensor would go unnoticed, which training never produces. ``frozen_only``
    hashes only the parameters that do not train: the base model a run's adapter is trained on.
    """
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, param in module.named_parameters():
            if frozen_only and param.requires_grad:
                continue
            flat = param.detach().reshape(-1)
            picked = flat[:: max(1, flat.numel() // samples)][:samples]
            digest.update(f"{name}|{tuple(param.shape)}|{param.dtype}".encode())
            digest.update(picked.float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def enable_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing of ``model`` (a Phi3V model, or a peft model of one: call it after the
    adapter is attached), with no input made to require a gradient.

    transformers (and peft, on a model that already checkpoints) hook every sub-model's input embeddings so that
    their outputs require grad, which reentrant checkpointing needs and non-reentrant does not. Phi3V's CLIP tower is
    such a sub-model: the hook on its patch embedding put a frozen tower in the graph, so every step back-propagated
    through all its layers (each recomputed) for no gradient, and held each checkpointed layer's input until then
    (bench/memory_timeline.py located it). The hooks are removed; a trained tower (LoRA in CLIP) is in the graph
    through its own parameters, and every trainable parameter gets the same gradient (tests/test_retriever.py).
    """
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    if hasattr(base, "activation_checkpointing_enable"):  # renamed within transformers 5.x
        base.activation_checkpointing_enable({"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.disable_input_require_grads()


def lora_module_names(retriever: Phi3VRetriever) -> set[str]:
    """Leaf names of the modules carrying LoRA weights (``qkv_proj``, ...), for checks and logs."""
    return {name.rsplit(".", 1)[-1] for name in lora_modules(retriever.model)}
