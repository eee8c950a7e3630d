"""What turns a conversation into tokens and back, with no engine state and no ``await``:
chat templates (:mod:`.templates`), tool definitions and calls (:mod:`.tools`,
:mod:`.call_formats`, kvrt's JSON envelope :mod:`.envelope`), grammars and JSON Schemas (:mod:`.grammar`, :mod:`.schemas`),
sampling (:mod:`.sampling`), stop sequences (:mod:`.stops`) and the memory of the replies
the runtime generated (:mod:`.replies`)."""
