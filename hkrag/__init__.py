"""HKRAG: holistic knowledge RAG over visually-rich documents.

Importing the package registers Phi-3-vision (``hkrag.models.phi3v``) with transformers' Auto classes,
so ``AutoModelForCausalLM`` / ``AutoProcessor.from_pretrained("microsoft/Phi-3-vision-128k-instruct")``
load our implementation without ``trust_remote_code``. Where transformers or torch is not installed
(a client of an LVLM server needs only ``hkrag.lvlm.openai_backend``), there is nothing to register.
"""

try:
    from hkrag.models import phi3v as phi3v  # registers the Auto classes
except ModuleNotFoundError as error:
    if error.name not in ("transformers", "torch"):
        raise
