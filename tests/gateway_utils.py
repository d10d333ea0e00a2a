"""Gateway helpers for tests: a gateway in a background thread (the benchmark tool's own
runner), and images as data URLs."""

from __future__ import annotations

import base64
import io

from PIL import Image

from pdcluster.benchmarks.targets import free_port
from pdcluster.benchmarks.targets import serve_in_thread as running

__all__ = ["data_url", "free_port", "running"]


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    mime = "image/png" if fmt == "PNG" else "image/jpeg"
    return f"data:{mime};base64,{base64.b64encode(buffer.getvalue()).decode()}"
