"""comix: collaborative, personalized fine-tuning of on-device LMs with mixtures of LoRA experts."""
__version__ = "0.1.0"

import logging as _logging  # noqa: E402

# bitsandbytes' CPU backend says at import (through PEFT, quantised base or not) that it cannot fetch
# a faster 4-bit kernel from the hub (the `kernels` package): comix runs offline on its built-in one
_logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(_logging.ERROR)
# ... and `kernels` >= 0.19, asked for that kernel with the hub offline, says it skips the publisher
# trust check of a kernel it then does not load
_logging.getLogger("kernels._internals.hf_hub").setLevel(_logging.ERROR)
# With ExecuTorch installed (the `device` extra), transformers imports torchao, whose CPU wheel
# says it cannot load its CUDA kernels and registers enums torch's pytree now handles itself:
# warnings about code comix never runs
_logging.getLogger("torchao").setLevel(_logging.ERROR)
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)

from .api import compare, export, load_personal, report, run  # noqa: E402  (the Python face; comix/api.py)

__all__ = ["run", "compare", "export", "load_personal", "report", "__version__"]
