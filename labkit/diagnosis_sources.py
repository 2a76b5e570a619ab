"""Where each of chapter 14's broken runs comes from: the public bug reports, forum threads and documentation pages
that show real users meeting the same mistake.

Every entry was found with the course's search tool (its corpora of GitHub issues, stored web pages and
documentation pages, November 2026). Its ``quote`` is copied verbatim from what the search returned, with its line
breaks kept or folded into spaces (web pages come back with layout breaks). None is written from memory.
``SOURCES`` maps a case name of ``labkit.broken_runs.BROKEN_RUNS`` to its list of sources, and ``LEFT_OUT`` the
issue's one mistake the registry leaves out; tests/unit/test_diagnosis_sources.py checks that every case has at least
one, and that each entry is complete. ``TORCH_CHANGES`` holds the pull requests of torch that the chapter's "How we
know" cites for a case (not reports of the mistake, so not linked under the case).
"""

from __future__ import annotations

SOURCES: dict[str, list[dict[str, str]]] = {
    # ---- data
    "same-samples-every-rank": [
        {"url": "https://github.com/PatrickHua/SimSiam/issues/16",
         "title": "Is \"DistributedSampler\" necessary? (PatrickHua/SimSiam #16)",
         "quote": "I find that there is no \"DistributedSampler\" in the code. Is it a normal setting? I think this "
                  "setting would make the model run the same data twice (or the number of GPU) in a single epoch"},
        {"url": "https://github.com/karpathy/llama2.c/issues/522",
         "title": "Missing Sampler when running on multiple GPUs using DDP (karpathy/llama2.c #522)",
         "quote": "Based on my understanding we need a sampler that will make sure a batch is not assigned to other "
                  "GPU so that we dont duplicate the training of the same batch."},
        {"url": "https://github.com/clovaai/voxceleb_trainer/issues/98",
         "title": "distribute training doesn't seems to split dataset between GPUs (clovaai/voxceleb_trainer #98)",
         "quote": "But the readme file mentioned each GPU will use the whole dataset in each epoch. So in each epoch, "
                  "dataset * 4 (if using 4 gpus) will go through GPUs, right?"},
    ],
    "no-set-epoch": [
        {"url": "https://discuss.pytorch.org/t/distributedsampler/90205",
         "title": "DistributedSampler (PyTorch Forums)",
         "quote": "If shuffle is turned on, it performs random permutation before subsampling.\n"
                  "You should use set_epoch function to modify the random seed for that."},
        {"url": "https://github.com/cszn/KAIR/issues/106",
         "title": "Bug fix in dist sampler that caused same data order in each epoch (cszn/KAIR #106)",
         "quote": "Please see the warning at the bottom of this page: "
                  "https://pytorch.org/docs/stable/data.html?highlight=set_epoch . For more details, you may refer "
                  "to this issue: pytorch/pytorch#31771"},
    ],
    "token-out-of-vocabulary": [
        {"url": "https://github.com/facebookresearch/XLM/issues/223",
         "title": "Multi-GPU training get stuck after one mini-batch (facebookresearch/XLM #223)",
         "quote": "I have run the same command with `CUDA_LAUNCH_BLOCKING=1`, and I get the output: [...] block: "
                  "[81,0,0], thread: [10,0,0] Assertion `srcIndex < srcSelectDimSize` failed."},
        {"url": "https://github.com/huggingface/transformers/issues/1062",
         "title": "Example in OpenAIGPTDoubleHeadsModel can't run (huggingface/transformers #1062)",
         "quote": "Although the tokenizer added new index for special tokens, the embedding in "
                  "OpenAIGPTDoubleHeadModel didn't add new embeddings for them, which leads to index out of range."},
        {"url": "https://github.com/mickeysjm/R-BERT/issues/5",
         "title": "Issue: IndexError: index out of range in self (mickeysjm/R-BERT #5)",
         "quote": "Seems to be related to the added special tokens, can be fixed by adding: \n"
                  "model.resize_token_embeddings(len(tokenizer))"},
        {"url": "https://docs.pytorch.org/docs/stable/notes/cuda.html#asynchronous-execution",
         "title": "CUDA semantics: asynchronous execution (PyTorch docs)",
         "quote": "You can force synchronous computation by setting environment variable ``CUDA_LAUNCH_BLOCKING=1``.  "
                  "This can be handy when an error occurs on the GPU. (With asynchronous execution, such an error "
                  "isn't reported until after the operation is actually executed, so the stack trace does not show "
                  "where it was requested.)"},
    ],
    # ---- data parallelism
    "accumulation-never-syncs": [
        {"url": "https://github.com/modelscope/FunASR/pull/3472",
         "title": "fix(train): align DDP no_sync with gradient accumulation (modelscope/FunASR #3472)",
         "quote": "The old batch_idx % accum_grad condition synchronizes the first microbatch and suppresses "
                  "synchronization on the optimizer-step microbatch, leaving rank-local accumulated gradients (4.0 "
                  "vs 7.0 in the reproduction)."},
        {"url": "https://github.com/karpathy/build-nanogpt/pull/30",
         "title": "fix sync issue that results in incorrect gradient accumulation and incorrect loss "
                  "(karpathy/build-nanogpt #30)",
         "quote": "This should have been a purely mechanical change that doesn't affect loss (1 -> 4 grad accum "
                  "steps), but comparing to @karpathy's run, the loss is clearly worse."},
        {"url": "https://github.com/pytorch/pytorch/issues/53443",
         "title": "DDP.no_sync() function + torch.cuda.synchronize(device=rank) (pytorch/pytorch #53443)",
         "quote": "For DDP, each process is accumulating grads locally in the `no_sync` mode and as a result have "
                  "different grads. Once, you run without no_sync, it will synchronize (allreduce) grads across all "
                  "processes to ensure all processes have the same grads."},
    ],
    "loss-averaged-twice": [
        {"url": "https://github.com/sanderwood/bgpt/issues/5",
         "title": "Loss Calucation (sanderwood/bgpt #5)",
         "quote": "the gradients will automatically be unscaled(divided) by world_size while doing loss.backword() "
                  "w.r.t. a model using DDP. So if we do one another time here at line 200, the gradient would be "
                  "world_size times smaller than the value it should have."},
        {"url": "https://github.com/NVIDIA/apex/issues/696",
         "title": "Questions about how DDP handles gradients (NVIDIA/apex #696)",
         "quote": "No need to divide by world_size."},
    ],
    "uneven-inputs": [
        {"url": "https://docs.pytorch.org/tutorials/advanced/generic_join.html",
         "title": "Distributed Training with Uneven Inputs Using the Join Context Manager (PyTorch tutorials)",
         "quote": "Such collective communications require participation from all ranks in the process group, so if a "
                  "rank has fewer inputs, then the other ranks will hang or error (depending on the backend)."},
        {"url": "https://github.com/microsoft/PyMarlin/issues/80",
         "title": "DDP Hangs with uneven batches (microsoft/PyMarlin #80)",
         "quote": "If you run training with an uneven number of batches on different GPUs, a hang will occur. Since "
                  "PyTorch 1.8.1, the join context manager on DDP exists to help with this situation."},
    ],
    # ---- FSDP
    "checkpoint-one-shard": [
        {"url": "https://pytorch.org/docs/stable/distributed.checkpoint",
         "title": "Distributed Checkpoint - torch.distributed.checkpoint (PyTorch docs)",
         "quote": "This function is different from torch.save() as it handles ShardedTensor , and DTensor by having "
                  "each rank only save their local shards."},
        {"url": "https://github.com/pytorch/pytorch/issues/73383",
         "title": "[FSDP] full_state_dict only on rank 0 (pytorch/pytorch #73383)",
         "quote": "All ranks will still need to call all collectives, otherwise this will result in desync."},
        {"url": "https://github.com/Lightning-AI/pytorch-lightning/issues/17702",
         "title": "Cannot save and load checkpoints with FSDPStrategy (Lightning-AI/pytorch-lightning #17702)",
         "quote": "- only rank 0 saves model\n- parameters not mapped correctly in state dict"},
    ],
    "bf16-gradient-reduction": [
        {"url": "https://github.com/pytorch/pytorch/issues/106395",
         "title": "FP32 accumulation of bf16 gradients in FSDP (pytorch/pytorch #106395)",
         "quote": "I was training a model (1B and 7B param llama-like architecture) using FSDP in bf16, and found "
                  "that it trained well on 12x8 GPUs, but the training would become unstable on 48x8 GPUs. After a "
                  "good deal of debugging, we found that changing `reduce_dtype` to `None` instead of `bf16` "
                  "resolved the issue."},
        {"url": "https://github.com/NVIDIA/Megatron-LM/issues/6199",
         "title": "[feat] GTP + grad-reduce-in-fp32 (NVIDIA/Megatron-LM #6199)",
         "quote": "A ring reduce-scatter rounds the partial sum at every one of its N-1 hops, so BF16 gradient error "
                  "grows as √N with the axis size"},
    ],
    "optimizer-before-sharding": [
        {"url": "https://github.com/huggingface/accelerate/pull/3394",
         "title": "Initial FSDP2 support (huggingface/accelerate #3394)",
         "quote": "highlight a \"broken\" part in PyTorch that creating an optimizer before applying `FSDP2` "
                  "**doesn't result in a working training loop**."},
        {"url": "https://github.com/intelligent-machine-learning/dlrover/issues/584",
         "title": "When using FSDP on the nanoGPT model, the loss does not decrease. "
                  "(intelligent-machine-learning/dlrover #584)",
         "quote": "When using FSDP on the nanoGPT model, the loss does not decrease but rather bounces around the "
                  "initial value.It is possible that the parameters are not being updated."},
        {"url": "https://github.com/huggingface/accelerate/issues/3209",
         "title": "The optimizer is not receiving the FSDP model parameters. (huggingface/accelerate #3209)",
         "quote": "does it mean that the optimizer actually does not take any parameters to update? So the model "
                  "parameters won't be updated in the training loop?"},
    ],
    # ---- tensor parallelism
    "data-by-global-rank": [
        {"url": "https://github.com/deepspeedai/DeepSpeed/issues/99",
         "title": "DeepSpeed using DistributedSampler with model parallelism (deepspeedai/DeepSpeed #99)",
         "quote": "If DeepSpeed is configured with model parallelism, or called from a library with a sub-group of "
                  "the world processes, the default behavior of `DistributedSampler` is incorrect because it queries "
                  "the global world size and rank information."},
        {"url": "https://github.com/aws/amazon-sagemaker-examples/pull/1983",
         "title": "Shard data based on dp_rank/dp_size when using model parallelism "
                  "(aws/amazon-sagemaker-examples #1983)",
         "quote": "Doing it based on global ranks (as is currently done) would result in some data samples being "
                  "skipped, since there are also model-parallel ranks."},
    ],
    # ---- pipelines
    "loss-on-wrong-stage": [
        {"url": "https://github.com/pytorch/torchtitan/issues/550",
         "title": "PP UX/training confusion re: loss = -1. (pytorch/torchtitan #550)",
         "quote": "For PP, only the last rank reports the loss. \nHowever, in titan, by default we only log the first "
                  "rank, rank 0.\nThis results in UX and user confusion in that doing a simple run with PP will "
                  "report an ongoing loss of -1...."},
        {"url": "https://github.com/pytorch/torchtitan/issues/547",
         "title": "[Bug] Loss=-1.0 and GPU memory keeps increasing in pipeline parallel (pytorch/torchtitan #547)",
         "quote": "Re: -1 for loss - when using Pipeline Parallel, only the last stage computes an actual loss.  "
                  "Thus, you will need to adjust your logging filter to include the final rank."},
        {"url": "https://github.com/huggingface/nanotron/pull/422",
         "title": "fix(trainer): guard loss_avg computation when pipeline parallelism is active "
                  "(huggingface/nanotron #422)",
         "quote": "With pipeline parallelism enabled (pp>1), only the last pipeline stage holds the loss tensor; "
                  "non-final ranks hold `None` or a zero tensor."},
    ],
    "too-few-microbatches": [
        {"url": "https://github.com/NVIDIA/Megatron-LM/issues/1829",
         "title": "[QUESTION] VPP argument setting (NVIDIA/Megatron-LM #1829)",
         "quote": "According to the current code logic ,If `microbatch_group_size_per_vp_stage` is smaller than "
                  "`pipeline_parallel_size`, there should be a large number of bubbles."},
        {"url": "https://huggingface.co/spaces/nanotron/ultrascale-playbook",
         "title": "The Ultra-Scale Playbook (nanotron), pipeline parallelism section",
         "quote": "On the left, with a number of micro-batches equal to or less than the PP degree minus one (m = p "
                  "- 1), we see how detrimental the pipeline bubble can be - performance is low and even drops as we "
                  "scale PP."},
    ],
    # ---- composition
    "fsdp-before-tp": [
        {"url": "https://github.com/pytorch/pytorch/issues/89884",
         "title": "[RFC] PyTorch Tensor Parallel(TP) User API for Distributed Training (pytorch/pytorch #89884)",
         "quote": "We will first parallelize modules within 8 GPUs on each host and then wrap the module with FSDP. "
                  "Basically TP first shards the weight of a module and then FSDP shards the local tensor of "
                  "TP-sharded weights."},
        {"url": "https://github.com/meta-pytorch/tnt/pull/1002",
         "title": "add TPStrategy + 1d/2d parallel dispatcher (meta-pytorch/tnt #1002)",
         "quote": "TP, AC, FSDP2, and torch compile require a specific order (TP -> AC -> compile -> fsdp2). The "
                  "current order in `prepare_module` is incompatible with this."},
        {"url": "https://github.com/pytorch/tutorials/pull/3465.patch",
         "title": "TP tutorial: fsdp1 -> fsdp2 (pytorch/tutorials #3465)",
         "quote": "# apply Tensor Parallel intra-host on tp_mesh model_tp = parallelize_module(model, tp_mesh, "
                  "tp_plan) # apply FSDP inter-host on dp_mesh"},
    ],
    # ---- operations
    "mismatched-collectives": [
        {"url": "https://github.com/speechbrain/speechbrain/issues/2401",
         "title": "Possible NCCL-level deadlock during checkpointing (speechbrain/speechbrain #2401)",
         "quote": "RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running collective: "
                  "CollectiveFingerPrint(SequenceNumber=485, OpType=ALLREDUCE, TensorShape=[25], [...] but Rank 0 "
                  "is running collective: CollectiveFingerPrint(SequenceNumber=485, OpType=BROADCAST, "
                  "TensorShape=[1], [...] Collectives differ in the following aspects:   Op type: ALLREDUCEvs "
                  "BROADCAST"},
        {"url": "https://pytorch.org/docs/stable/torch_nccl_environment_variables.html",
         "title": "PYTORCH ProcessGroupNCCL Environment Variables (PyTorch docs)",
         "quote": "Control whether Desync Debug is enabled. This is helpful in figuring out the culprit rank of "
                  "collective desync."},
    ],
    "resume-without-rng": [
        {"url": "https://github.com/pytorch/torchtitan/issues/1213",
         "title": "[Flux] Incorrect loss after loading from checkpoint (pytorch/torchtitan #1213)",
         "quote": "After loading from checkpoint, the loss spikes and then returns to expected values after a few "
                  "steps."},
        {"url": "https://github.com/KempnerInstitute/KempnerForge/issues/51",
         "title": "Dataloader state not persisted across checkpoints (KempnerInstitute/KempnerForge #51)",
         "quote": "Every resume replays the first epoch from scratch:\n`StatefulDataLoader.batches_yielded` resets to "
                  "zero, `MixtureSampler`\nre-weighting state is lost, and `DistributedSampler` per-epoch shuffle\n"
                  "position is lost. Repeated or skipped examples result."},
        {"url": "https://github.com/ai2cm/ace/issues/690",
         "title": "RNG state resets after resuming training from a checkpoint (ai2cm/ace #690)",
         "quote": "RNG state as set by for data loading and certain config objects (e.g., `TimeLengthProbabilities`) "
                  "as set by `set_seed` at the beginning of training is reset to its initial value when resuming "
                  "training after preemption."},
    ],
    "slow-rank": [
        {"url": "https://github.com/pytorch/pytorch/issues/71303",
         "title": "[RFC] Cross-Process Performance Analysis: Straggler Detection (pytorch/pytorch #71303)",
         "quote": "DDP is highly sensitive to stragglers -- the allreduce-based gradient synchronization has to wait "
                  "for the slowest process at every iteration."},
        {"url": "https://github.com/traceopt-ai/traceml/issues/252",
         "title": "Backward-origin compute straggler is undetectable: DDP all-reduce equalizes per-rank backward "
                  "wall time (traceopt-ai/traceml #252)",
         "quote": "The DDP gradient all-reduce acts as a barrier inside backward: rank 1's backward is grad compute "
                  "plus the injected delay, while every other rank's backward is grad compute plus an equal "
                  "all-reduce wait."},
        {"url": "https://github.com/intelligent-machine-learning/dlrover/issues/678",
         "title": "Automatically detect the straggler. (intelligent-machine-learning/dlrover #678)",
         "quote": "In the collective communication job, the straggler will significantly affect the performance of "
                  "training. If there are many nodes in a cluster, it is difficult to detect which node is the "
                  "straggler."},
    ],
    # ---- later cases
    "full-state-on-rank-0": [
        {"url": "https://github.com/pytorch/pytorch/issues/122903",
         "title": "Unable to save FSDP sharded model with FullStateDictConfig(offload_to_cpu=True, rank0_only=True) "
                  "(pytorch/pytorch #122903)",
         "quote": "When attempting to save an FSDP wrapped model using the `with FSDP.state_dict_type` context "
                  "manager, the process hangs when running the `fsdp_model.state_dict` function on rank 0."},
        {"url": "https://github.com/pytorch/pytorch/issues/73383",
         "title": "[FSDP] full_state_dict only on rank 0 (pytorch/pytorch #73383)",
         "quote": "All ranks will still need to call all collectives, otherwise this will result in desync."},
    ],
    "per-rank-init": [
        {"url": "https://github.com/allenai/OLMo-core/pull/319",
         "title": "fix initialization (again) (allenai/OLMo-core #319)",
         "quote": "Unlike DDP, PyTorch's `fully_shard()` (FSDP) wrapper doesn't synchronize to make sure parameters "
                  "are consistent across the process group. So when you init your rank-local tensors with different "
                  "seeds, you end up with inconsistent parameters across replica groups."},
        {"url": "https://github.com/mosaicml/llm-foundry/pull/830",
         "title": "Use `sync_module_states: True` when using HSDP (mosaicml/llm-foundry #830)",
         "quote": "If a user is training from scratch with one of the HSDP hybrid sharding strategies, they must use "
                  "`sync_module_states: True` otherwise the different data replicas will start with different "
                  "randomly initialized weights."},
        {"url": "https://github.com/pytorch/torchtitan/issues/1777",
         "title": "[FSDP2] support sync_module_states in FSDP2 (pytorch/torchtitan #1777)",
         "quote": "both DDP and FSDP1 broadcast weights from rank0 to other ranks, because each rank may have "
                  "different rng before applying DDP/FSDP1"},
    ],
    "local-grad-norm": [
        {"url": "https://github.com/pytorch/pytorch/issues/72548",
         "title": "Implement clip_grad_norm for FSDP models (pytorch/pytorch #72548)",
         "quote": "For FSDP, since parameters are sharded across ranks, simply using clip_grad_norm_  would be "
                  "incorrect as `model.parameters()` does not return the full set of unsharded parameters and thus "
                  "gradient clipping would be applied incorrectly."},
    ],
    "stage-grad-norm": [
        {"url": "https://github.com/pytorch/torchtitan/issues/596",
         "title": "Gradient norm clipping with pipeline parallelism (PP) (pytorch/torchtitan #596)",
         "quote": "My understanding is that since the model is manually sharded, calling "
                  "`torch.nn.utils.clip_grad_norm_` will only compute the grad norm based on the modules of the "
                  "current PP stage."},
        {"url": "https://github.com/pytorch/pytorch/issues/139467",
         "title": "Seperate grad norm computation from `torch.nn.utils.clip_grad_norm_` (pytorch/pytorch #139467)",
         "quote": "When using pipeline parallelism (PP), the grad norm need to be computed on each PP stage and then "
                  "reduced across all PP stages."},
        {"url": "https://github.com/Modalities/modalities/issues/313",
         "title": "Pipeline parallelism requires special gradient clipping implementation (Modalities/modalities #313)",
         "quote": "For PP, the gradients of the  different stages would not be accumulated."},
    ],
    "nan-from-one-rank": [
        {"url": "https://github.com/allenai/OLMo-core/pull/657",
         "title": "Fix NaN loss when all labels on a rank are label_ignore_index (allenai/OLMo-core #657)",
         "quote": "This causes `batch_num_tokens_for_loss` to be 0, leading to a division-by-zero in the loss "
                  "computation (`loss_reduction=\"sum\"` / 0 → NaN). The NaN then propagates to all ranks via "
                  "`all_reduce`, crashing the entire training run."},
        {"url": "https://github.com/ecmwf/WeatherGenerator/pull/2718",
         "title": "Make loss-spike batch skip a global all-reduce decision across ranks (ecmwf/WeatherGenerator #2718)",
         "quote": "a NaN or spike on ranks 1..N-1 with a finite rank-0 loss was never skipped and its gradients "
                  "poisoned the all-reduce"},
    ],
    "token-mean-per-micro-batch": [
        {"url": "https://github.com/meta-pytorch/torchtune/pull/1875",
         "title": "Normalize CE loss by total number of (non-padding) tokens (meta-pytorch/torchtune #1875)",
         "quote": "In honor of the day the ML community first discovered the fact that (x1 / n1) + (x2 / n2) != "
                  "(x1 + x2) / (n1 + n2)"},
        {"url": "https://github.com/meta-pytorch/torchtune/pull/1917",
         "title": "Restore backward after each batch for grad accum (meta-pytorch/torchtune #1917)",
         "quote": "# Get total number of tokens across all ranks to normalize gradients"},
        {"url": "https://github.com/karpathy/nanochat/pull/59",
         "title": "Fix gradient accumulation for variable length sequences (karpathy/nanochat #59)",
         "quote": "Previously, gradients were scaled by `grad_accum_steps` assuming equal tokens per batch, causing "
                  "incorrect weighting when padding varies across micro-batches."},
        {"url": "https://github.com/ruimalheiro/gradient-garden/pull/113",
         "title": "fix post training loss calculation (ruimalheiro/gradient-garden #113)",
         "quote": "DDP(including FSDP) already in theory scales the gradients by the number of ranks, so we just "
                  "need to multiple by number of ranks / number of valid tokens."},
    ],
    "global-batch-grows": [
        {"url": "https://github.com/apache/mxnet/issues/11919",
         "title": "Accuracy changes with number of GPUs (apache/mxnet #11919)",
         "quote": "Since the actual batch size differs by 2x it's not surprising that accuracy can be different."},
        {"url": "https://github.com/TorchSSL/TorchSSL/issues/15",
         "title": "Some questions about multi-gpu training (TorchSSL/TorchSSL #15)",
         "quote": "Directly adding more GPUs and increasing the batch will affect the result."},
        {"url": "https://github.com/BVLC/caffe/issues/4465",
         "title": "Clarification on multi-GPU training effective batch size (BVLC/caffe #4465)",
         "quote": "it will only take caffe 25 iterations to see the entire training set.  That being said, if caffe "
                  "is set to run for a set number of iterations, the model with better trained when using additional "
                  "GPUs."},
    ],
    "unused-parameter": [
        {"url": "https://github.com/ImprintLab/MedSegDiff/issues/27",
         "title": "Why there are some unused parameters? (ImprintLab/MedSegDiff #27)",
         "quote": "it looks like you define some parameterized layer in 'class NetWorkxx: def __init__' but not used "
                  "in the forward"},
        {"url": "https://github.com/open-mmlab/mmdetection/pull/4742",
         "title": "Add FAQ (open-mmlab/mmdetection #4742)",
         "quote": "This error indicates that your module has parameters that were not used in producing loss. This "
                  "phenomenon may be caused by running different branches in your code in DDP mode."},
    ],
    "rank-0-evaluation": [
        {"url": "https://github.com/huggingface/accelerate/issues/223",
         "title": "Multi-GPU Training+Single-GPU Eval runs into time out (huggingface/accelerate #223)",
         "quote": "we run into a timeout when we evaluate for more than 30 minutes on a single GPU. Is there a way to "
                  "tell the other GPU to wait until the main GPU completes the evaluation?"},
        {"url": "https://github.com/cfzd/Ultra-Fast-Lane-Detection-v2/issues/119",
         "title": "DDP训练，一直卡在Evaluating the results...不动，然后Watchdog caught collective operation timeout "
                  "(cfzd/Ultra-Fast-Lane-Detection-v2 #119)",
         "quote": "Evaluating the results...\n[E ProcessGroupNCCL.cpp:821] [Rank 3] Watchdog caught collective "
                  "operation timeout: WorkNCCL(SeqNum=4178, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1803391 "
                  "milliseconds before timing out."},
        {"url": "https://assaf-pinhasi.medium.com/great-writeup-thanks-for-sharing-5e2d99e0b5d9",
         "title": "Great writeup, thanks for sharing (a reader's reply on Medium)",
         "quote": "When your \"main\" worker is busy doing stuff like running the validation or writing checkpoints, "
                  "for example at the end of the nth epoch, the other workers already start the next epoch."},
    ],
}


# The one mistake the registry leaves out (labkit/broken_runs.py says why: the course's model has no
# dropout). The chapter still names it and its sources.
LEFT_OUT: dict[str, list[dict[str, str]]] = {
    "tp-dropout-random-stream": [
        {"url": "https://github.com/awslabs/slapo/issues/21",
         "title": "[Feature] Random seed management for dropout layers in distributed environment "
                  "(awslabs/slapo #21)",
         "quote": "Specifically, the activation dropout needs to use the same random seed, while attention weight "
                  "dropout requires to use different random seeds since the weight is partitioned in the tensor "
                  "parallelism case."},
        {"url": "https://github.com/PaddlePaddle/PaddleFleetX/pull/1005",
         "title": "Fix dropout random seed for sequence parallel. (PaddlePaddle/PaddleFleetX #1005)",
         "quote": "Fix bug of GPT sequence_parallel. Different input partition in Dropout should use different "
                  "random seed if sequence_parallel is True."},
        {"url": "https://github.com/NVIDIA/Fuser/issues/3123",
         "title": "Sharded dropout. (NVIDIA/Fuser #3123)",
         "quote": "To ensure dropout works correctly, the dropout in different shards needs to be randomized in "
                  "different patterns."},
        {"url": "https://github.com/ecmwf/anemoi-core/issues/595",
         "title": "Caution - Using dropout with model sharding - Revisit random seed generation "
                  "(ecmwf/anemoi-core #595)",
         "quote": "current implementation for random seed generation implies that every rank in the model group gets "
                  "the same random seed. While each rank gets different inputs,  if dropout is activated the "
                  "elements dropped would the \"same\" which can lead to unexpected behaviour or patterns in the "
                  "model between ranks."},
    ],
}


# Torch's own changes that chapter 14's "How we know" cites, in the order they happened: why Schedule1F1B refuses
# fewer microbatches than stages while GPipe runs with them, where TORCH_DISTRIBUTED_DEBUG=DETAIL's check of
# every collective comes from, and why torchrun's summary prints a traceback only with @record, its root cause last.
# Found with the search tool (corpus: issues), December 2026; quotes verbatim (#66182's from its commit message, as
# the v1.10.0 tag's notes reproduce it).
TORCH_CHANGES: dict[str, list[dict[str, str]]] = {
    "too-few-microbatches": [
        {"url": "https://github.com/pytorch/pytorch/pull/144702",
         "title": "[PP] Don't allow for num_microbatches > num_stages for single stage schedules "
                  "(pytorch/pytorch #144702)",
         "quote": "There is an edge case where `Schedule1F1B` will hang when num_microbatches=1 "
                  "(https://github.com/pytorch/torchtitan/issues/775). [...] I think this is a regression as the "
                  "bug was only in the 1F1B scheduler, GPipe worked with MB < PP."},
        {"url": "https://github.com/pytorch/pytorch/pull/171462",
         "title": "Remove MB < PP check for Gpipe (pytorch/pytorch #171462)",
         "quote": "Move the microbatches < pipeline stages check only for 1F1B, since we don't want to restrict "
                  "Gpipe"},
    ],
    "token-out-of-vocabulary": [
        {"url": "https://github.com/pytorch/pytorch/pull/64036",
         "title": "[torch/elastic] Pretty print the failure message captured by @record (pytorch/pytorch #64036)",
         "quote": "This PR slightly revises the implementation of the internal `_format_failure()` method in order to "
                  "pretty print the error message captured in a subprocess by the `@record` annotation."},
        {"url": "https://github.com/pytorch/pytorch/pull/66182",
         "title": "(torch/elastic) add fqdn hostname to error printout (pytorch/pytorch #66182)",
         "quote": "2. moves the \"root cause\" section to the end (presumably since the logs are being \"tailed\" we want "
                  "the root cause to appear at the end) [...] NOTE: YOU HAVE TO annotate your main function with "
                  "torch.distributed.elastic.multiprocessing.errors.record, otherwise no traceback is printed (this is "
                  "because python exception propagation does NOT work out of the both for IPC - hence the extra "
                  "record annotation)."},
    ],
    "mismatched-collectives": [
        {"url": "https://github.com/pytorch/pytorch/pull/58224",
         "title": "[c10d] Introduce ProcessGroupWrapper (pytorch/pytorch #58224)",
         "quote": "Verify op type consistency. This can help catch mismatched ops in the user application (i.e. "
                  "allreduce on one rank and allgather on another) [...] This is done through an abstraction called "
                  "`CollectiveFingerPrint` which uses a helper process group to do the above verification."},
        {"url": "https://github.com/pytorch/pytorch/pull/58281",
         "title": "[c10d] Use pg wrapper in detailed debug mode (pytorch/pytorch #58281)",
         "quote": "When TORCH_DISTRIBUTED_DEBUG=DETAIL is enabled, this PR causes process groups created by "
                  "`new_group` and `init_process_group` that are nccl or gloo to be wrapped in `ProcessGroupWrapper`."},
    ],
}


def sources_for(case: str) -> list[dict[str, str]]:
    """The public reports a broken run (or a case left out) comes from; an empty list for one with none recorded."""
    return SOURCES.get(case, LEFT_OUT.get(case, []))
