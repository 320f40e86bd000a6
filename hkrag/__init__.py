"""HKRAG: holistic knowledge RAG over visually-rich documents.

Importing the package registers Phi-3-vision (``hkrag.models.phi3v``) with transformers' Auto classes,
so ``AutoModelForCausalLM`` / ``AutoProcessor.from_pretrained("microsoft/Phi-3-vision-128k-instruct")``
load our implementation without ``trust_remote_code``.
"""

from hkrag.models import phi3v as phi3v  # registers the Auto classes
