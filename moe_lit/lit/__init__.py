"""Lightning integration: the LightningModule, the datamodule, the CLI and the programmatic runner."""
