#!/usr/bin/env bash
# The Fashion-MNIST study (README.md beside this file): eight methods at five seeds, two runs at a time (one
# thread each), into one sweep directory whose report compares every method with mixup=none seed by seed.
# Three sweeps, since a Hydra sweep crosses its lists: the mixers at their shipped configs; PuzzleMix with
# cells that tile a 28x28 image (its CIFAR cells of 4 do not); Random Erasing beside no mixer.
#   bash docs/fashion_mnist_study/run.sh [SWEEP_DIR]     (default multirun/fashion_mnist_study)
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-multirun/fashion_mnist_study}
common=(experiment=fashion_mnist_study hydra/launcher=joblib hydra.launcher.n_jobs=2 "hydra.sweep.dir=$out")
python train.py -m seed=0,1,2,3,4 mixup=none,input,manifold,cutmix,saliencymix,regmixup "${common[@]}" \
    'hydra.sweep.subdir=mixup/${hydra.job.num}'
python train.py -m seed=0,1,2,3,4 mixup=puzzlemix mixup.neigh_size=7 mixup.t_size=7 "${common[@]}" \
    'hydra.sweep.subdir=puzzlemix/${hydra.job.num}'
python train.py -m seed=0,1,2,3,4 erasing=random "${common[@]}" 'hydra.sweep.subdir=erasing/${hydra.job.num}'
python -m mixhook.app.report "$out" >/dev/null
