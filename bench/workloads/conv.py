"""Convolutional training: torchvision ResNet-50 (weights=None), bf16 autocast, channels-last,
SGD with momentum, the image size drawn per step (multi-scale training)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

NAME = "conv"
DEFAULTS = {"steps": 10, "warmup": 3, "batch": 64, "cap_gib": 12.0, "search_steps": 3}


def add_args(p):
    g = p.add_argument_group(NAME)
    g.add_argument("--sizes", default="160,192,224,256,288,320",
                   help="image sizes drawn from per step (the largest is the search's last step)")
    g.add_argument("--classes", type=int, default=1000)
    g.add_argument("--arch", default="resnet50")


class Conv:
    def __init__(self, args, device):
        import torch
        import torchvision

        if args.tiny:
            args.sizes, args.classes, args.arch = "32,48,64", 10, "resnet18"
        self.args, self.device = args, device
        self.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        self.cuda = device.startswith("cuda")
        torch.backends.cudnn.benchmark = False
        model = getattr(torchvision.models, args.arch)(weights=None, num_classes=args.classes)
        self.model = model.to(device=device, memory_format=torch.channels_last)
        self.model.train()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        self.loss = torch.nn.CrossEntropyLoss()
        n = sum(p.numel() for p in self.model.parameters())
        self._info = dict(params=n, trainable_params=n, arch=args.arch, sizes=self.sizes,
                          amp="bfloat16" if self.cuda else None)

    def info(self):
        return self._info

    def sample(self, rng, batch, final_max=False):
        size = max(self.sizes) if final_max else rng.choice(self.sizes)
        return {"size": size, "seed": rng.randrange(1 << 30)}

    def work(self, batch, shape):
        return batch

    def step(self, batch, shape):
        import torch

        g = torch.Generator(device=self.device)
        g.manual_seed(shape["seed"])
        s = shape["size"]
        x = torch.randn(batch, 3, s, s, device=self.device, generator=g)
        x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, self.args.classes, (batch,), device=self.device, generator=g)
        with torch.autocast(device_type="cuda" if self.cuda else "cpu", dtype=torch.bfloat16,
                            enabled=self.cuda):
            loss = self.loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def reset(self):
        self.opt.zero_grad(set_to_none=True)


def build(args, device):
    return Conv(args, device)


if __name__ == "__main__":
    sys.exit(common.main(globals()))
