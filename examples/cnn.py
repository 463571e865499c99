"""A small ResNet-style image classifier in plain torch (conv + batch norm + residuals).

    autopar profile examples/cnn.py model.width=64 model.blocks=8 model.image=64
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual; stride 2 halves the image and doubles channels."""

    def __init__(self, channels_in: int, channels_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = (nn.Identity() if stride == 1 and channels_in == channels_out else
                         nn.Sequential(nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False),
                                       nn.BatchNorm2d(channels_out)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int, blocks: int, classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, channels = [], width
        for index in range(blocks):
            # Downsample at the start of the second and third quarter of the network.
            downsample = index in (blocks // 4, blocks // 2) and index > 0
            layers.append(BasicBlock(channels, channels * 2 if downsample else channels, 2 if downsample else 1))
            channels = channels * 2 if downsample else channels
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.blocks(self.stem(images))
        return self.head(features.mean(dim=(2, 3)))


def build_model(width: int = 16, blocks: int = 4, classes: int = 10) -> nn.Module:
    return ResNet(width, blocks, classes)


def example_batch(batch_size: int, image: int = 32, classes: int = 10):
    return {"images": torch.randn(batch_size, 3, image, image), "labels": torch.randint(0, classes, (batch_size,))}


def loss_fn(logits: torch.Tensor, batch: dict) -> torch.Tensor:
    return F.cross_entropy(logits, batch["labels"])
