"""Dense prediction on Pola backbones: detection and instance segmentation (torchvision), semantic segmentation
(segmentation_models_pytorch). See docs/dense.md."""
