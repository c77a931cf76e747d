#include "dialect.h"
#include "dynamic_conv.h"
