"""--finetune lora and qlora: peft's adapters on a frozen base (lora.py).

A package of its own, above precision/ (a target may be a precision layer, and a qlora base is
NF4, tierlm.precision.nf4) and models/ (the merged export reads the base through the loader),
below runtime/ (which sizes and runs the adapted model). The frozen base as the tiered runtime
holds it is tierlm.runtime.frozen."""
