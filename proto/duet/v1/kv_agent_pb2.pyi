from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class KVJoin(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "layout_json", "regions_json", "mode")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    REGIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    layout_json: str
    regions_json: str
    mode: str
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., layout_json: _Optional[str] = ..., regions_json: _Optional[str] = ..., mode: _Optional[str] = ...) -> None: ...

class KVWelcome(_message.Message):
    __slots__ = ("error", "agent_name", "agent_metadata", "layout_json", "regions_json")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    REGIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    error: str
    agent_name: str
    agent_metadata: bytes
    layout_json: str
    regions_json: str
    def __init__(self, error: _Optional[str] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., layout_json: _Optional[str] = ..., regions_json: _Optional[str] = ...) -> None: ...

class KVLeave(_message.Message):
    __slots__ = ("agent_name",)
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    def __init__(self, agent_name: _Optional[str] = ...) -> None: ...

class KVLeft(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVPing(_message.Message):
    __slots__ = ("agent_name",)
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    def __init__(self, agent_name: _Optional[str] = ...) -> None: ...

class KVPong(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...
