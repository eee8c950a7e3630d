"""The only code in kvrt that touches C APIs and native memory.

Every wrapper validates its arguments before the native call: an input that would reach a
``GGML_ASSERT`` aborts the whole process, so none may get through. Failures come back as
:class:`BridgeError` subclasses.
"""

from ._errors import BridgeArgumentError as BridgeArgumentError
from ._errors import BridgeCallError as BridgeCallError
from ._errors import BridgeError as BridgeError
from ._errors import BridgeLoadError as BridgeLoadError
