"""Does packed flex attention train on this GPU in bf16 and fp32 (fresh process each)?"""
import sys
import tempfile
from pathlib import Path

from hellbender.config import validate_config
from hellbender.train.run import train
from tests.helpers import base_config, logged_losses

bf16 = sys.argv[1] == "bf16"
tmp = Path(tempfile.mkdtemp())
cfg = validate_config(base_config(tmp, attn_implementation="flex_attention", adapter="lora", lora_target_linear=True,
                                  sample_packing=True, max_steps=3, bf16=bf16))
try:
    train(cfg)
    print("PROBE", sys.argv[1], "ok", logged_losses(cfg.output_dir))
except Exception as exc:
    print("PROBE", sys.argv[1], type(exc).__name__, str(exc).splitlines()[0][:200])
