{
  description = "attention-int8: INT8 scaled-dot-product attention for the Hugging Face kernel hub";

  # Prebuilt Torch/CUDA toolchains, so that a build does not compile every PyTorch from source.
  nixConfig = {
    extra-substituters = [ "https://huggingface.cachix.org" ];
    extra-trusted-public-keys = [
      "huggingface.cachix.org-1:ynTPbLS0W8ofXd9fDjk1KvoFky9K2jhxe6r4nXAkc/o="
    ];
  };

  # kernel-builder at a fixed commit of huggingface/kernels (one that reads build.toml edition 6); flake.lock
  # pins it and its own inputs by hash. To move to a newer builder, change the commit and re-run `nix flake lock`.
  inputs = {
    kernel-builder.url = "github:huggingface/kernels/03dd3532d47037340a77a5bf23684d6d0394b73d";
  };

  outputs =
    { self, kernel-builder, ... }:
    kernel-builder.lib.genKernelFlakeOutputs {
      # The op namespace of each build is derived from self's git revision.
      inherit self;
      path = ./.;
      # Test-only dependencies of `nix run .#ci-test` and the test shells.
      pythonCheckInputs = pkgs: with pkgs; [
        hypothesis
        numpy
      ];
    };
}
