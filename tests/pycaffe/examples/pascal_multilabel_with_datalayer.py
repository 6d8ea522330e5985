# BVLC Caffe's examples/pascal-multilabel-with-datalayer.ipynb, its code cells run as a script
# (see README.md here): plotting and the download cell removed, Python 2 ported, and, for CPU
# time, CaffeNet fed 99 x 99 images (was 227) in batches of 2 (was 128), with fewer steps and
# test batches. The test runs it from <stand-in caffe_root>/examples, where pycaffe/ holds the
# data layer and tools.py, and a stand-in PASCAL VOC folder.
# Caffe's code as written, so its style is exempt from this project's lint rules:
# ruff: noqa: B007, E402, I001, UP030, UP032, W291, W293

# ---- cell 3
import sys 
import os

import numpy as np
import os.path as osp

from copy import copy

caffe_root = '../'  # this file is expected to be in {caffe_root}/examples
sys.path.append(caffe_root + 'python')
import caffe # If you get "No module named _caffe", either you have not built pycaffe or you have the wrong path.

from caffe import layers as L, params as P # Shortcuts to define the net prototxt.

sys.path.append("pycaffe/layers") # the datalayers we will use are in this directory.
sys.path.append("pycaffe") # the tools file is in this folder

import tools #this contains some tools that we need

# ---- cell 5
# set data root directory, e.g:
pascal_root = osp.join(caffe_root, 'data/pascal/VOC2012')

# these are the PASCAL classes, we'll need them later.
classes = np.asarray(['aeroplane', 'bicycle', 'bird', 'boat', 'bottle', 'bus', 'car', 'cat', 'chair', 'cow', 'diningtable', 'dog', 'horse', 'motorbike', 'person', 'pottedplant', 'sheep', 'sofa', 'train', 'tvmonitor'])

# make sure we have the caffenet weight downloaded.
if not os.path.isfile(caffe_root + 'models/bvlc_reference_caffenet/bvlc_reference_caffenet.caffemodel'):
    raise FileNotFoundError('the test writes a stand-in CaffeNet caffemodel')  # was a download

# initialize caffe for gpu mode
caffe.set_mode_gpu()
caffe.set_device(0)

# ---- cell 7
# helper function for common structures
def conv_relu(bottom, ks, nout, stride=1, pad=0, group=1):
    conv = L.Convolution(bottom, kernel_size=ks, stride=stride,
                                num_output=nout, pad=pad, group=group)
    return conv, L.ReLU(conv, in_place=True)

# another helper function
def fc_relu(bottom, nout):
    fc = L.InnerProduct(bottom, num_output=nout)
    return fc, L.ReLU(fc, in_place=True)

# yet another helper function
def max_pool(bottom, ks, stride=1):
    return L.Pooling(bottom, pool=P.Pooling.MAX, kernel_size=ks, stride=stride)

# main netspec wrapper
def caffenet_multilabel(data_layer_params, datalayer):
    # setup the python data layer 
    n = caffe.NetSpec()
    n.data, n.label = L.Python(module = 'pascal_multilabel_datalayers', layer = datalayer, 
                               ntop = 2, param_str=str(data_layer_params))

    # the net itself
    n.conv1, n.relu1 = conv_relu(n.data, 11, 96, stride=4)
    n.pool1 = max_pool(n.relu1, 3, stride=2)
    n.norm1 = L.LRN(n.pool1, local_size=5, alpha=1e-4, beta=0.75)
    n.conv2, n.relu2 = conv_relu(n.norm1, 5, 256, pad=2, group=2)
    n.pool2 = max_pool(n.relu2, 3, stride=2)
    n.norm2 = L.LRN(n.pool2, local_size=5, alpha=1e-4, beta=0.75)
    n.conv3, n.relu3 = conv_relu(n.norm2, 3, 384, pad=1)
    n.conv4, n.relu4 = conv_relu(n.relu3, 3, 384, pad=1, group=2)
    n.conv5, n.relu5 = conv_relu(n.relu4, 3, 256, pad=1, group=2)
    n.pool5 = max_pool(n.relu5, 3, stride=2)
    n.fc6, n.relu6 = fc_relu(n.pool5, 4096)
    n.drop6 = L.Dropout(n.relu6, in_place=True)
    n.fc7, n.relu7 = fc_relu(n.drop6, 4096)
    n.drop7 = L.Dropout(n.relu7, in_place=True)
    n.score = L.InnerProduct(n.drop7, num_output=20)
    n.loss = L.SigmoidCrossEntropyLoss(n.score, n.label)
    
    return str(n.to_proto())

# ---- cell 9
workdir = './pascal_multilabel_with_datalayer'
if not os.path.isdir(workdir):
    os.makedirs(workdir)

solverprototxt = tools.CaffeSolver(trainnet_prototxt_path = osp.join(workdir, "trainnet.prototxt"), testnet_prototxt_path = osp.join(workdir, "valnet.prototxt"))
solverprototxt.sp['display'] = "1"
solverprototxt.sp['base_lr'] = "0.0001"
solverprototxt.write(osp.join(workdir, 'solver.prototxt'))

# write train net.
with open(osp.join(workdir, 'trainnet.prototxt'), 'w') as f:
    # provide parameters to the data layer as a python dictionary. Easy as pie!
    data_layer_params = dict(batch_size = 2, im_shape = [99, 99], split = 'train', pascal_root = pascal_root)  # were 128, [227, 227]
    f.write(caffenet_multilabel(data_layer_params, 'PascalMultilabelDataLayerSync'))

# write validation net.
with open(osp.join(workdir, 'valnet.prototxt'), 'w') as f:
    data_layer_params = dict(batch_size = 2, im_shape = [99, 99], split = 'val', pascal_root = pascal_root)  # (as above)
    f.write(caffenet_multilabel(data_layer_params, 'PascalMultilabelDataLayerSync'))

# ---- cell 11
solver = caffe.SGDSolver(osp.join(workdir, 'solver.prototxt'))
solver.net.copy_from(caffe_root + 'models/bvlc_reference_caffenet/bvlc_reference_caffenet.caffemodel')
solver.test_nets[0].share_with(solver.net)
solver.step(1)
train_losses = [float(solver.net.blobs['loss'].data)]  # added: kept for the test

# ---- cell 13
transformer = tools.SimpleTransformer() # This is simply to add back the bias, re-shuffle the color channels to RGB, and so on...
image_index = 0 # First image in the batch.
shown = transformer.deprocess(copy(solver.net.blobs['data'].data[image_index, ...]))  # was plt.imshow
gtlist = solver.net.blobs['label'].data[image_index, ...].astype(int)  # numpy 2: was np.int
print('GT: {}'.format(classes[np.where(gtlist)]))  # was plt.title

# ---- cell 16
def hamming_distance(gt, est):
    return sum([1 for (g, e) in zip(gt, est) if g == e]) / float(len(gt))

def check_accuracy(net, num_batches, batch_size = 2):  # was 128, the batch size above
    acc = 0.0
    for t in range(num_batches):
        net.forward()
        gts = net.blobs['label'].data
        ests = net.blobs['score'].data > 0
        for gt, est in zip(gts, ests): #for each ground truth and estimated label vector
            acc += hamming_distance(gt, est)
    return acc / (num_batches * batch_size)

# ---- cell 18
accuracies = []  # added: kept for the test
for itt in range(6):
    solver.step(3)  # was 100
    train_losses.append(float(solver.net.blobs['loss'].data))  # added: kept for the test
    accuracies.append(check_accuracy(solver.test_nets[0], 4))  # added: kept for the test
    print('itt:{:3d}'.format((itt + 1) * 3), 'accuracy:{0:.4f}'.format(accuracies[-1]))  # (100, 50 batches)

# ---- cell 20
def check_baseline_accuracy(net, num_batches, batch_size = 2):  # was 128
    acc = 0.0
    for t in range(num_batches):
        net.forward()
        gts = net.blobs['label'].data
        ests = np.zeros((batch_size, len(gts)))
        for gt, est in zip(gts, ests): #for each ground truth and estimated label vector
            acc += hamming_distance(gt, est)
    return acc / (num_batches * batch_size)

baseline = check_baseline_accuracy(solver.test_nets[0], 4)  # was 5823/128 batches
print('Baseline accuracy:{0:.4f}'.format(baseline))

# ---- cell 22
test_net = solver.test_nets[0]
for image_index in range(2):  # was 5, past a batch of 2
    shown = transformer.deprocess(copy(test_net.blobs['data'].data[image_index, ...]))  # was plt.imshow
    gtlist = test_net.blobs['label'].data[image_index, ...].astype(int)  # numpy 2: was np.int
    estlist = test_net.blobs['score'].data[image_index, ...] > 0
    print('GT: {} \n EST: {}'.format(classes[np.where(gtlist)], classes[np.where(estlist)]))  # was plt.title
