"""comix: collaborative, personalized fine-tuning of on-device LMs with mixtures of LoRA experts."""
__version__ = "0.1.0"
