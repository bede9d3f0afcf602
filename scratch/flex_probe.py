"""Which shapes does compiled flex attention (torch.compile defaults, as transformers compiles it) lower on this GPU?"""
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def causal(b, h, q, kv):
    return q >= kv


for dtype in (torch.float32, torch.bfloat16):
    for head_dim, seq, gqa in ((16, 127, True), (16, 128, False), (16, 127, False), (32, 127, True), (64, 127, True)):
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, dynamic=False)
        q = torch.randn(4, 4, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(4, 2 if gqa else 4, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        mask = create_block_mask(causal, 4, 1, seq, seq, device="cuda")
        try:
            fn(q, k, v, block_mask=mask, enable_gqa=gqa).sum().backward()
            result = "ok"
        except Exception as exc:
            result = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        print(f"PROBE {str(dtype)[6:]} head_dim={head_dim} seq={seq} gqa={gqa}: {result}", flush=True)
