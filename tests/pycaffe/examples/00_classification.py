# BVLC Caffe's examples/00-classification.ipynb, its code cells run as a script (see README.md
# here): plotting, display and shell magics removed (the %timeit cells 23 and 25, which only
# time forward passes, with them), Python 2 ported. The test runs it from
# <stand-in caffe_root>/examples with stand-ins for the downloads.
# Caffe's code as written, so its style is exempt from this project's lint rules:
# ruff: noqa: E402, I001, W293

# ---- cell 2
# set up Python environment: numpy for numerical routines, and matplotlib for plotting
import numpy as np

# ---- cell 4
# The caffe module needs to be on the Python path;
#  we'll add it here explicitly.
import sys
caffe_root = '../'  # this file should be run from {caffe_root}/examples (otherwise change this line)
sys.path.insert(0, caffe_root + 'python')

import caffe
# If you get "No module named _caffe", either you have not built pycaffe or you have the wrong path.

# ---- cell 6
import os
if os.path.isfile(caffe_root + 'models/bvlc_reference_caffenet/bvlc_reference_caffenet.caffemodel'):
    print('CaffeNet found.')
else:
    raise FileNotFoundError('the test writes a stand-in CaffeNet caffemodel')  # was a download

# ---- cell 8
caffe.set_mode_cpu()

model_def = caffe_root + 'models/bvlc_reference_caffenet/deploy.prototxt'
model_weights = caffe_root + 'models/bvlc_reference_caffenet/bvlc_reference_caffenet.caffemodel'

net = caffe.Net(model_def,      # defines the structure of the model
                model_weights,  # contains the trained weights
                caffe.TEST)     # use test mode (e.g., don't perform dropout)

# ---- cell 10
# load the mean ImageNet image (as distributed with Caffe) for subtraction
mu = np.load(caffe_root + 'python/caffe/imagenet/ilsvrc_2012_mean.npy')
mu = mu.mean(1).mean(1)  # average over pixels to obtain the mean (BGR) pixel values
print('mean-subtracted values:', list(zip('BGR', mu)))

# create transformer for the input called 'data'
transformer = caffe.io.Transformer({'data': net.blobs['data'].data.shape})

transformer.set_transpose('data', (2,0,1))  # move image channels to outermost dimension
transformer.set_mean('data', mu)            # subtract the dataset-mean value in each channel
transformer.set_raw_scale('data', 255)      # rescale from [0, 1] to [0, 255]
transformer.set_channel_swap('data', (2,1,0))  # swap channels from RGB to BGR

# ---- cell 12
# set the size of the input (we can skip this if we're happy
#  with the default; we can also change it later, e.g., for different batch sizes)
net.blobs['data'].reshape(50,        # batch size
                          3,         # 3-channel (BGR) images
                          227, 227)  # image size is 227x227

# ---- cell 14
image = caffe.io.load_image(caffe_root + 'examples/images/cat.jpg')
transformed_image = transformer.preprocess('data', image)

# ---- cell 16
# copy the image data into the memory allocated for the net
net.blobs['data'].data[...] = transformed_image

### perform classification
output = net.forward()

output_prob = output['prob'][0]  # the output probability vector for the first image in the batch

print('predicted class is:', output_prob.argmax())
cat_probs = output['prob'].copy()  # added: kept for the test (cell 45 overwrites the blob)

# ---- cell 18
# load ImageNet labels
labels_file = caffe_root + 'data/ilsvrc12/synset_words.txt'
    
labels = np.loadtxt(labels_file, str, delimiter='\t')

print('output label:', labels[output_prob.argmax()])

# ---- cell 20
# sort top five predictions from softmax output
top_inds = output_prob.argsort()[::-1][:5]  # reverse sort and take five largest items

print('probabilities and labels:')
print(list(zip(output_prob[top_inds], labels[top_inds])))

# ---- cell 28
# for each layer, show the output shape
for layer_name, blob in net.blobs.items():
    print(layer_name + '\t' + str(blob.data.shape))

# ---- cell 30
for layer_name, param in net.params.items():
    print(layer_name + '\t' + str(param[0].data.shape), str(param[1].data.shape))

# ---- cell 32
def vis_square(data):
    """Take an array of shape (n, height, width) or (n, height, width, 3)
       and visualize each (height, width) thing in a grid of size approx. sqrt(n) by sqrt(n)"""
    
    # normalize data for display
    data = (data - data.min()) / (data.max() - data.min())
    
    # force the number of filters to be square
    n = int(np.ceil(np.sqrt(data.shape[0])))
    padding = (((0, n ** 2 - data.shape[0]),
               (0, 1), (0, 1))                 # add some space between filters
               + ((0, 0),) * (data.ndim - 3))  # don't pad the last dimension (if there is one)
    data = np.pad(data, padding, mode='constant', constant_values=1)  # pad with ones (white)
    
    # tile the filters into an image
    data = data.reshape((n, n) + data.shape[1:]).transpose((0, 2, 1, 3) + tuple(range(4, data.ndim + 1)))
    data = data.reshape((n * data.shape[1], n * data.shape[3]) + data.shape[4:])
    
    return data  # was plt.imshow(data); plt.axis('off')

# ---- cell 34
# the parameters are a list of [weights, biases]
filters = net.params['conv1'][0].data
filter_tiles = vis_square(filters.transpose(0, 2, 3, 1))

# ---- cell 36
feat = net.blobs['conv1'].data[0, :36]
conv1_tiles = vis_square(feat)

# ---- cell 38
feat = net.blobs['pool5'].data[0]
pool5_tiles = vis_square(feat)

# ---- cell 40
feat = net.blobs['fc6'].data[0]
_ = np.histogram(feat.flat[feat.flat > 0], bins=100)  # was plt.hist

# ---- cell 42
feat = net.blobs['prob'].data[0]

# ---- cell 45
# download an image
# (stand-in: the test wrote image.jpg, which `!wget -O image.jpg $my_image_url` fetched)

# transform it and copy it into the net
image = caffe.io.load_image('image.jpg')
net.blobs['data'].data[...] = transformer.preprocess('data', image)

# perform classification
net.forward()

# obtain the output probabilities
output_prob = net.blobs['prob'].data[0]

# sort top five predictions from softmax output
top_inds = output_prob.argsort()[::-1][:5]

print('probabilities and labels:')
print(list(zip(output_prob[top_inds], labels[top_inds])))
