"""Why a cell failed, and what the verdict sees: localization stage by stage, explanation by omission, observability, the field's metrics, a mixture of experts' routing."""
