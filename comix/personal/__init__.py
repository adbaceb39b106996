"""A user's personalised model outside comix.

``export_personal(method_dir, user, out)`` writes, into a temporary folder renamed at the end:
  * every user model: ``manifest.json`` (method spec, the user's client index, the run's config,
    each expert's id and role, top-k, scaling, which modules; the base model's spec and a SHA-256
    of its weights) and ``comix_adapters.safetensors`` (the user's adapters as comix names them,
    routers included), from which ``load_personal`` rebuilds the exact model;
  * plain-LoRA users (FedAvg, Local, FedIT, FFA-/FedSA-LoRA, FDLoRA's fused pair, ...): a standard
    PEFT LoRA folder at the top (``adapter_config.json``, ``adapter_model.safetensors``) that
    ``PeftModel.from_pretrained(base, out)`` loads with comix's logits; ``merged=True`` adds
    ``merged/``, the base with the LoRA merged, for ``AutoModelForCausalLM.from_pretrained``;
  * mixture users (CoMiGS, pFedMoE, ...): ``experts/<j>/`` one PEFT LoRA folder per expert (the
    attention LoRA plus expert j's LoRA on every MLP projection: the model the router would give
    if it always picked expert j) and ``routers.safetensors``; ``static=True`` adds ``static/``,
    one PEFT adapter of the experts combined with the user's mean routing weights by PEFT's
    ``add_weighted_adapter(..., combination_type="cat")`` (an approximation: routing is per token
    and the MLP is not linear; the manifest says so), for servers that take one LoRA per request.
  * other layers (FedAMoLE's AMoLE, soft prompts; kind ``comix``): the adapters and the manifest
    only, which ``load_personal`` rebuilds (no PEFT form exists for them); FedAMoLE adds
    ``experts/<id>/``, per held global expert the PEFT LoRA of "routers always pick it";
  * a method whose model is the server's (DeepFusion, FedJETS; kind ``global-moe``): the run's
    Mixtral folder as ``model/``, one model for every user;
  * ``with_base`` (default for the tiny random models comix builds): ``base/``, the base model as a
    transformers folder, named by every PEFT folder's ``base_model_name_or_path`` (an absolute path:
    move the export and that path goes stale), so ``AutoPeftModelForCausalLM`` loads it offline.
``--merged`` is refused in one line for a mixture (no single merged model equals per-token routing).
Not PEFT's X-LoRA format: in peft 0.21.2 its save drops the classifier's weights and its single
classifier cannot express CoMiGS's per-layer token routers.
"""
from .export import export_personal
from .load import load_any, load_personal
from .peft_forms import mean_routing, write_peft_lora
from .run_folder import (ADAPTERS, GLOBAL, MANIFEST, ExportError, method_dirs, rebuild, resolve_method_dir, run_config,
                         weights_sha256)

__all__ = ["ADAPTERS", "GLOBAL", "MANIFEST", "ExportError", "export_personal", "load_any", "load_personal", "mean_routing",
           "method_dirs", "rebuild", "resolve_method_dir", "run_config", "weights_sha256", "write_peft_lora"]
