"""What this CPU's torch build computes, for the tests of features that exist only where it does.

torch packs its CPU int4 weight-only layout (``_convert_weight_to_int4pack_for_cpu``) one way on CPUs with AVX-512
and another on those without (seen on an AVX2-only AMD EPYC). The kernel-layout records (``loader/codec.py``) hold
the AVX-512 layout; where this build packs differently the loader holds such records decoded instead, a fallback
``tests/loader/test_kernel_layout.py`` checks on every CPU by pretending the layouts differ.
"""

from __future__ import annotations

import pytest
import torch

from loader.forms import _nibble_repack_matches, int4pack_available

needs_int4pack = pytest.mark.skipif(not int4pack_available(torch.device("cpu")),
                                    reason="this torch build has no CPU int4 weight-only kernel")
needs_kernel_layout = pytest.mark.skipif(
    not _nibble_repack_matches(),
    reason="this CPU's torch packs int4pack in another layout than kernel-layout records hold (the AVX-512 one): "
           "the loader holds them decoded here (tests/loader/test_kernel_layout.py checks that fallback)")
