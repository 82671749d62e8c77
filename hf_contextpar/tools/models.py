"""`hf_contextpar.tools.models`, which earlier READMEs taught, is `hf_contextpar.models` (the built-in
models), the very module, so what a script sets on one it finds on the other."""

import sys

from .. import models

sys.modules[__name__] = models
