"""Every section type of the package in one union, for functions that take any of them (no builder
is imported here: the section modules read no disk)."""

from __future__ import annotations

from typing import ClassVar, Protocol

from automodel.data.pretrain_sections import MegatronPretrainingSection, NanogptSection
from automodel.data.streaming_section import StreamingSection
from automodel.data.text_sections import DatasetSection, SFTDatasetSection

#: a dataset section of any kind (the ``*Validation*`` subclasses included)
DataSection = (
    MegatronPretrainingSection | NanogptSection | StreamingSection | DatasetSection | SFTDatasetSection
)
#: the sections whose rows are read from local text files (json / text / parquet / csv)
RowsSection = DatasetSection | SFTDatasetSection


class ExampleSection(Protocol):
    """What SFT encoding reads of a section: `SFTDatasetSection`'s keys, which other front ends'
    sections (automodel-recipes' SQuAD and HellaSwag) answer too."""

    SECTION: ClassVar[str]
    PATH_KEY: ClassVar[str]

    @property
    def source(self) -> str: ...
    @property
    def split(self) -> str: ...
    @property
    def name(self) -> str | None: ...
    @property
    def seq_length(self) -> int: ...
    @property
    def path_or_dataset_id(self) -> str | list | None: ...
    @property
    def limit_dataset_samples(self) -> int | None: ...
    @property
    def chat_template(self) -> str | None: ...
    @property
    def use_hf_chat_template(self) -> bool | None: ...
    @property
    def truncate(self) -> bool: ...
    @property
    def answer_only_loss_mask(self) -> bool: ...
