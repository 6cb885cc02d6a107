"""Shardline's `resnet-bn` in torch: torchvision's ResNet-18 for small images (conv1 a 3x3
stride-1 convolution, no max-pool, fc to the classes), with torchvision's module names, so
that `shardline checkpoint export` of a resnet-bn run loads strictly:

    from safetensors.torch import load_file
    m = ResNetBN(in_channels=1, classes=10, width=4)
    m.load_state_dict(load_file("model.safetensors"), strict=True)

torchvision's `resnet18` has fixed widths (64, 128, 256, 512); this class scales them by
`width / 64` (Shardline's `--width`). At width 64 it is, name for name and shape for shape,
what `torchvision_equivalent` builds from torchvision (when torchvision is installed).

    python3 bench/resnet_bn.py --width 4 --in-channels 1 --classes 10 --check model.safetensors
"""
import argparse

import torch
import torch.nn as nn


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock: conv1-bn1-relu-conv2-bn2, plus the shortcut
    (`downsample`: 1x1 convolution and BatchNorm where the shape changes), then relu."""

    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNetBN(nn.Module):
    """ResNet-18 (two BasicBlocks per layer) with widths width * (1, 2, 4, 8)."""

    def __init__(self, in_channels=3, classes=10, width=64, blocks=(2, 2, 2, 2)):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity()
        c_in = width
        for i, (n, mult) in enumerate(zip(blocks, (1, 2, 4, 8))):
            c_out = width * mult
            layer = []
            for j in range(n):
                layer.append(BasicBlock(c_in, c_out, 2 if i > 0 and j == 0 else 1))
                c_in = c_out
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(c_in, classes)
        for m in self.modules():  # torchvision's init
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def torchvision_equivalent(in_channels=3, classes=10):
    """torchvision's resnet18 modified as resnet-bn (width 64); needs torchvision."""
    import torchvision
    m = torchvision.models.resnet18(num_classes=classes)
    m.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
    m.maxpool = nn.Identity()
    return m


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--in-channels", type=int, default=3)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--check", metavar="FILE", help="load FILE strictly and run one eval forward")
    a = ap.parse_args()
    m = ResNetBN(a.in_channels, a.classes, a.width)
    if a.check:
        from safetensors.torch import load_file
        sd = load_file(a.check)
        print(m.load_state_dict(sd, strict=True))
        m.eval()
        y = m(torch.zeros(2, a.in_channels, 8, 8))
        print(f"strict load ok: {len(sd)} tensors; eval logits {tuple(y.shape)}")
    else:
        for k, v in m.state_dict().items():
            print(k, str(v.dtype).removeprefix("torch."), tuple(v.shape))
