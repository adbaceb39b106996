"""comix: collaborative, personalized fine-tuning of on-device LMs with mixtures of LoRA experts."""
__version__ = "0.1.0"

from .api import compare, export, load_personal, report, run  # noqa: E402  (the Python face; comix/api.py)

__all__ = ["run", "compare", "export", "load_personal", "report", "__version__"]
